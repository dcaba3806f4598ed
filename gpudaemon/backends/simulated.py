"""Simulated GPUs: a first-class backend for demos, tests and benchmarks.

Readings are a pure function of (seed, GPU index, poll number, elapsed time), so a
seeded run is reproducible. Faults (XID, lost GPU, ECC) fire at a configured time or
poll and behave like their NVML counterparts.

A GPU may carry a per-call latency profile (`nvml_latency_us`, microseconds per NVML
call): a sample then costs what the NVML calls the real backend makes for it cost
(`SAMPLE_CALLS`, `ENERGY_CALLS`). The time is spent once per step, as a busy wait for
the sum (NVML calls are CPU time in the driver, and one `time.sleep` per call would
charge at least ~50 us each, far more than most real calls).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gpudaemon.backends import gpm, migprofiles
from gpudaemon.backends.base import (
    ENERGY_CALLS,
    GPM_CALLS,
    GPM_MIG_CALLS,
    HEALTH_CALLS,
    NVLINK_CALL,
    RETIRED_PAGES_CALLS,
    SAMPLE_CALLS,
    is_critical_xid,
    lost_sample,
)
from gpudaemon.errors import ProfileError
from gpudaemon.health import signals
from gpudaemon.health.verdict import judge
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    MigSample,
    NodeInventory,
)
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


def _spend(seconds: float) -> None:
    """Take `seconds` of wall time the way an NVML call does: on the CPU. Sleeps only
    the part of a long wait that a sleep's overshoot cannot spoil."""
    if seconds <= 0.0:
        return
    end = time.perf_counter() + seconds
    if seconds > 0.002:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, got a boolean")
    return v


# Finite, bounded numbers (an .inf wattage would put Infinity into the annotation's JSON).
Number = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]
Count = Annotated[int, BeforeValidator(_not_bool), Field(le=10**12)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


def _reject_unused(names: set[str], what: str) -> None:
    if names:
        raise ValueError(f"{', '.join(sorted(names))}: not used by {what} (remove it)")


Flag = Annotated[bool, Field(strict=True)]  # true/false, not 1 or "yes"
RecoveryAction = Literal["none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset"]
ClockEvent = Literal["hw_slowdown", "hw_thermal", "sw_thermal", "hw_power_brake"]

# The fields each fault kind reads; set on another kind they would be ignored.
_KIND_FIELDS: dict[str, set[str]] = {
    "xid": {"xid", "count"},
    "ecc": {"corrected", "uncorrected"},
    "lost": set(),
    "row_remap": {"pending", "failure", "correctable", "uncorrectable"},
    "recovery_action": {"action"},
    "nvlink_errors": {"link", "crc_flit", "crc_data", "replay", "recovery"},
    "clock_event": {"reasons"},
}


class FaultSpec(_Strict):
    kind: Literal[
        "xid", "lost", "ecc", "row_remap", "recovery_action", "nvlink_errors", "clock_event"
    ]
    gpu: int | None = None  # node-level faults name the GPU index
    xid: Annotated[int, Field(ge=1, le=1_000_000)] = 79
    count: Annotated[Count, Field(ge=1)] = 1
    corrected: Annotated[Count, Field(ge=0)] = 0
    uncorrected: Annotated[Count, Field(ge=0)] = 0
    # row_remap: the remapper's state from now on; rows are added to its counts.
    pending: Flag = False
    failure: Flag = False
    correctable: Annotated[Count, Field(ge=0)] = 0
    uncorrectable: Annotated[Count, Field(ge=0)] = 0
    # recovery_action: the driver's recovery action from now on.
    action: RecoveryAction = "none"
    # nvlink_errors: counts added to one link's counters on every poll from now on.
    link: Annotated[int, Field(ge=0, le=35), BeforeValidator(_not_bool)] = 0
    crc_flit: Annotated[Count, Field(ge=0)] = 0
    crc_data: Annotated[Count, Field(ge=0)] = 0
    replay: Annotated[Count, Field(ge=0)] = 0
    recovery: Annotated[Count, Field(ge=0)] = 0
    # clock_event: the clock event reasons active from now on ([] ends them).
    reasons: tuple[ClockEvent, ...] = ()
    after_s: Annotated[Number, Field(ge=0, le=1e9)] = 0.0
    after_polls: Annotated[Count, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> FaultSpec:
        """A field of another kind would be ignored, so it is an error; a fault that
        would change nothing is one too."""
        others = set().union(*_KIND_FIELDS.values()) - _KIND_FIELDS[self.kind]
        _reject_unused(self.model_fields_set & others, f"kind {self.kind}")
        if self.kind == "ecc" and not (self.corrected or self.uncorrected):
            raise ValueError("kind ecc needs corrected or uncorrected above 0")
        if self.kind == "row_remap" and not self.model_fields_set & _KIND_FIELDS["row_remap"]:
            raise ValueError(
                "kind row_remap needs one of pending, failure, correctable, uncorrectable"
            )
        if self.kind == "recovery_action" and "action" not in self.model_fields_set:
            raise ValueError(
                "kind recovery_action needs action (none, gpu_reset, node_reboot, "
                "drain_p2p, drain_and_reset)"
            )
        if self.kind == "nvlink_errors" and not (
            self.crc_flit or self.crc_data or self.replay or self.recovery
        ):
            raise ValueError(
                "kind nvlink_errors needs crc_flit, crc_data, replay or recovery above 0"
            )
        if self.kind == "clock_event" and "reasons" not in self.model_fields_set:
            raise ValueError("kind clock_event needs reasons (a list; [] ends the events)")
        return self


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
    # NVML call name -> its mean latency in microseconds on this GPU (absent: free).
    nvml_latency_us: dict[str, Annotated[Number, Field(ge=0.0, le=1e6)]] = {}

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


def _cost_s(spec: GpuSpec, calls: tuple[str, ...]) -> float:
    return sum(spec.nvml_latency_us.get(c, 0.0) for c in calls) / 1e6


def _health_cost_s(spec: GpuSpec) -> float:
    """What NvmlBackend.health_counters costs this GPU: the health fields, the retired
    pages before Ampere, and 4 error counters per NVLink link."""
    calls = HEALTH_CALLS + (() if _ampere(spec) else RETIRED_PAGES_CALLS)
    links = spec.nvlink_links or 0
    nvlink = links * len(signals.NVLINK_ERROR_COUNTERS) * spec.nvml_latency_us.get(NVLINK_CALL, 0.0)
    return _cost_s(spec, calls) + nvlink / 1e6


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


@dataclass
class _SimGpu:
    info: GpuInfo
    spec: GpuSpec
    faults: list[FaultSpec]
    energy_joules: float = 0.0
    walk: float = 0.5
    xids: dict[int, int] = field(default_factory=dict)
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    lost: bool = False
    first_critical_xid: int | None = None
    # One stream per GPU, seeded once: the n-th sample of a GPU is the same for the same
    # seed, and seeding a generator per sample cost more than the rest of the sample.
    rng: random.Random = field(default_factory=random.Random)
    sample_cost_s: float = 0.0  # what NVML would take for this GPU's sample
    mig_generation: int = 0  # how many times the MIG layout was changed
    energy_cost_s: float = 0.0  # ... and for its energy read
    health_cost_s: float = 0.0  # ... and for its health counters' read
    # Health signals (health/signals.py names).
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failed: bool = False
    recovery_action: str = "none"
    nvlink: dict[int, dict[str, int]] = field(default_factory=dict)
    nvlink_adders: list[FaultSpec] = field(default_factory=list)  # fired nvlink_errors
    clock_events: frozenset[str] = frozenset()
    clock_seconds: dict[str, float] = field(default_factory=dict)
    # GPM: whether a previous poll's sample exists (the first poll has no value), the
    # cost of the GPU's and of each GPU instance's GPM calls, the byte counters.
    gpm_primed: bool = False
    gpm_cost_s: float = 0.0
    gpm_mig_cost_s: float = 0.0
    gpm_counters: gpm.Counters = field(default_factory=gpm.Counters)

    def cost_s(self) -> float:
        """What NVML would take for this GPU's sample, GPM included."""
        if not has_gpm(self.spec):
            return self.sample_cost_s
        return (
            self.sample_cost_s + self.gpm_cost_s + self.gpm_mig_cost_s * len(self.info.mig_devices)
        )


class SimulatedBackend:
    """Backend over a Profile. Thread-safe: the scheduler may call it from workers."""

    name = "simulated"

    def __init__(
        self,
        profile: Profile,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.profile = profile
        self.seed = seed if seed is not None else (profile.seed or 0)
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self._polls = 0
        self._lock = threading.Lock()
        self._gpus = self._build()
        self._mig_changes = sorted(profile.mig_changes, key=lambda c: c.after_s)

    def boot_id(self) -> str:
        return self.profile.boot_id

    def _build(self) -> list[_SimGpu]:
        gpus: list[_SimGpu] = []
        for spec in self.profile.gpus:
            for _ in range(spec.count):
                index = len(gpus)
                uuid = spec.uuid or self._uuid(f"gpu:{index}")  # uuid implies count 1
                major, minor = (int(x) for x in spec.compute_capability.split("."))
                migs = self._mig_devices(index, spec, spec.mig.instances, 0)
                info = GpuInfo(
                    index=index,
                    uuid=uuid,
                    name=spec.name,
                    memory_total_bytes=spec.memory_total_mib * MIB,
                    compute_capability=(major, minor),
                    pci_bus_id=f"00000000:{0x18 + index * 0x10 & 0xFF:02X}:00.0",
                    mig_capable=spec.mig.capable or spec.mig.enabled,
                    mig_enabled=spec.mig.enabled,
                    mig_devices=migs,
                    nvlink_links=spec.nvlink_links,
                )
                faults = list(spec.faults)
                faults += [f for f in self.profile.faults if f.gpu == index]
                gpus.append(
                    _SimGpu(
                        info=info,
                        spec=spec,
                        faults=faults,
                        walk=spec.utilization.mean,
                        rng=random.Random(f"{self.seed}:{index}"),
                        sample_cost_s=_cost_s(spec, SAMPLE_CALLS),
                        energy_cost_s=_cost_s(spec, ENERGY_CALLS),
                        health_cost_s=_health_cost_s(spec),
                        gpm_cost_s=_cost_s(spec, GPM_CALLS),
                        gpm_mig_cost_s=_cost_s(spec, GPM_MIG_CALLS),
                        nvlink={
                            link: dict.fromkeys(signals.NVLINK_ERROR_TYPES, 0)
                            for link in range(spec.nvlink_links or 0)
                        },
                        clock_seconds=dict.fromkeys(signals.CLOCK_EVENT_DURATION_FIELDS, 0.0),
                    )
                )
        return gpus

    def _mig_devices(
        self, index: int, spec: GpuSpec, instances: tuple[str, ...], generation: int
    ) -> tuple[MigDevice, ...]:
        if not spec.mig.enabled:
            return ()
        table = migprofiles.profiles_for(spec.name, spec.memory_total_mib) or {}
        out = []
        for i, name in enumerate(instances):
            p = table[name]
            key = f"mig:{index}:{i}" if generation == 0 else f"mig:{index}:{generation}:{i}"
            out.append(
                MigDevice(
                    uuid="MIG-" + self._uuid(key).removeprefix("GPU-"),
                    profile=name,
                    gpu_instance_id=i + 1,
                    compute_instance_id=0,
                    memory_total_bytes=p.memory_mib * MIB,
                    multiprocessors=p.multiprocessors,
                    gpu_instance_slices=p.slices,
                    compute_instance_slices=p.slices,
                    copy_engines=p.copy_engines,
                    decoders=p.decoders,
                    encoders=p.encoders,
                    jpeg_engines=p.jpeg_engines,
                    ofa_engines=p.ofa_engines,
                )
            )
        return tuple(out)

    def set_mig_layout(self, index: int, instances: tuple[str, ...]) -> None:
        """Replace GPU `index`'s MIG instances (new UUIDs, as real re-creation gives);
        ProfileError if the GPU is not in MIG mode or the layout does not fit."""
        with self._lock:
            self._set_mig_layout(index, tuple(instances))

    def _set_mig_layout(self, index: int, instances: tuple[str, ...]) -> None:
        if not 0 <= index < len(self._gpus):
            raise ProfileError(f"no GPU {index}")
        g = self._gpus[index]
        if not g.spec.mig.enabled:
            raise ProfileError(f"GPU {index} is not in MIG mode")
        why = mig_layout_error(g.spec.name, g.spec.memory_total_mib, instances)
        if why:
            raise ProfileError(f"GPU {index}: {why}")
        g.mig_generation += 1
        migs = self._mig_devices(index, g.spec, instances, g.mig_generation)
        g.info = dataclasses.replace(g.info, mig_devices=migs)

    def _apply_mig_changes(self, elapsed: float) -> None:
        while self._mig_changes and self._mig_changes[0].after_s <= elapsed:
            c = self._mig_changes.pop(0)
            self._set_mig_layout(c.gpu, c.instances)

    def _uuid(self, key: str) -> str:
        digest = hashlib.sha256(f"{self.profile.source}:{self.seed}:{key}".encode()).digest()
        return "GPU-" + str(uuidlib.UUID(bytes=digest[:16], version=4))

    # -- Backend interface -------------------------------------------------------

    def inventory(self) -> NodeInventory:
        with self._lock:
            self._apply_mig_changes(self._clock() - self._start)
        major, _, minor = self.profile.cuda_version.partition(".")
        cuda = (int(major), int(minor or 0)) if major.isdigit() else None
        return NodeInventory(
            driver_version=self.profile.driver_version,
            cuda_driver_version=cuda,
            gpus=tuple(g.info for g in self._gpus),
            backend=self.name,
        )

    def sample(self) -> tuple[GpuSample, ...]:
        with self._lock:
            now = self._clock()
            dt = max(0.0, now - self._last)
            self._last = now
            self._polls += 1
            elapsed = now - self._start
            self._apply_mig_changes(elapsed)
            out = tuple(self._sample_one(g, elapsed, dt) for g in self._gpus)
            _spend(sum(g.cost_s() for g in self._gpus if not g.lost))
            return out

    def energy(self) -> dict[int, float | None]:
        """The energy each GPU has used since the simulated driver loaded, in joules:
        power integrated over the samples so far (None for a lost GPU)."""
        with self._lock:
            _spend(sum(g.energy_cost_s for g in self._gpus if not g.lost))
            return {g.info.index: None if g.lost else round(g.energy_joules, 3) for g in self._gpus}

    def health_counters(self) -> None:
        """Charges the health counters' NVML calls; the simulated signals themselves
        are in every sample (the faults fire there)."""
        with self._lock:
            _spend(sum(g.health_cost_s for g in self._gpus if not g.lost))

    def close(self) -> None:
        pass

    # -- test and demo hooks -----------------------------------------------------

    def inject(self, index: int, fault: FaultSpec) -> None:
        """Queue a fault on one GPU; it fires on the next sample that meets its timing."""
        with self._lock:
            self._gpus[index].faults.append(fault)

    # -- readings ----------------------------------------------------------------

    def _fire_faults(self, g: _SimGpu, elapsed: float) -> None:
        pending = []
        for f in g.faults:
            if elapsed < f.after_s or self._polls <= f.after_polls:
                pending.append(f)
                continue
            if f.kind == "lost":
                g.lost = True
            elif f.kind == "xid":
                g.xids[f.xid] = g.xids.get(f.xid, 0) + f.count
                if is_critical_xid(f.xid) and g.first_critical_xid is None:
                    g.first_critical_xid = f.xid
            elif f.kind == "ecc":
                g.ecc_corrected += f.corrected
                g.ecc_uncorrected += f.uncorrected
            elif f.kind == "row_remap":
                g.remapped_correctable += f.correctable
                g.remapped_uncorrectable += f.uncorrectable
                if "pending" in f.model_fields_set:
                    g.remap_pending = f.pending
                if "failure" in f.model_fields_set:
                    g.remap_failed = f.failure
            elif f.kind == "recovery_action":
                g.recovery_action = f.action
            elif f.kind == "nvlink_errors":
                g.nvlink_adders.append(f)
            else:
                g.clock_events = frozenset(f.reasons)
        g.faults = pending

    def _health_signals(self, g: _SimGpu, dt: float) -> dict[str, Any]:
        """The health readings a real GPU of this spec gives (absent where it gives none)."""
        spec = g.spec
        for f in g.nvlink_adders:  # counts added per poll
            c = g.nvlink[f.link]
            c["crc_flit"] += f.crc_flit
            c["crc_data"] += f.crc_data
            c["replay"] += f.replay
            c["recovery"] += f.recovery
        for reason in g.clock_events & g.clock_seconds.keys():
            g.clock_seconds[reason] += dt
        out: dict[str, Any] = {
            "recovery_action": g.recovery_action,
            "clock_events_active": g.clock_events,
            "clock_event_seconds_total": {k: round(v, 3) for k, v in g.clock_seconds.items()},
            "nvlink_errors_total": {link: dict(c) for link, c in g.nvlink.items()},
        }
        if spec.ecc and _ampere(spec):
            out.update(
                remapped_rows_correctable=g.remapped_correctable,
                remapped_rows_uncorrectable=g.remapped_uncorrectable,
                row_remap_pending=g.remap_pending,
                row_remap_failed=g.remap_failed,
            )
        elif spec.ecc:  # before Ampere: page retirement instead of row remapping
            out.update(
                retired_pages_single_bit=0, retired_pages_double_bit=0, retired_pages_pending=False
            )
        return out

    def _utilization(self, g: _SimGpu, rng: random.Random, elapsed: float) -> float:
        u = g.spec.utilization
        noise = rng.gauss(0.0, u.noise) if u.noise else 0.0
        if u.pattern == "idle":
            value = abs(noise) * 0.2
        elif u.pattern == "busy":
            value = 0.97 + noise
        elif u.pattern == "sine":
            value = u.mean + u.amplitude * math.sin(2 * math.pi * elapsed / u.period_s) + noise
        elif u.pattern == "random-walk":
            g.walk += 0.2 * (u.mean - g.walk) + noise
            g.walk = min(1.0, max(0.0, g.walk))
            value = g.walk
        else:
            value = u.mean + noise
        return min(1.0, max(0.0, value))

    def _sample_one(self, g: _SimGpu, elapsed: float, dt: float) -> GpuSample:
        self._fire_faults(g, elapsed)
        info, spec = g.info, g.spec
        xids = dict(g.xids)
        if g.lost:
            return lost_sample(info.index, info.uuid, xids)
        health = self._health_signals(g, dt)
        rng = g.rng
        util = self._utilization(g, rng, elapsed)
        mean = 0.0 if spec.utilization.pattern == "idle" else spec.utilization.mean
        total = info.memory_total_bytes
        mem_frac = min(0.95, max(0.0, 0.005 + 0.85 * mean + rng.gauss(0.0, 0.005)))
        used = int(total * mem_frac) // MIB * MIB
        power = spec.power_max_watts * (0.1 + 0.85 * util) + rng.gauss(0.0, 1.0)
        g.energy_joules += power * dt
        busy = util > 0.05
        util = round(util, 4)
        reading = self._gpm(g, util, dt)
        migs = tuple(
            MigSample(
                uuid=m.uuid,
                memory_total_bytes=m.memory_total_bytes,
                memory_used_bytes=int(m.memory_total_bytes * mem_frac) // MIB * MIB,
                gpm=_mig_gpm(reading, k),
            )
            for k, m in enumerate(info.mig_devices)
        )
        sample = GpuSample(
            index=info.index,
            uuid=info.uuid,
            gpu_utilization_ratio=util,
            memory_utilization_ratio=round(min(1.0, util * 0.6), 4),
            memory_used_bytes=used,
            memory_free_bytes=total - used,
            memory_total_bytes=total,
            temperature_celsius=round(30.0 + 50.0 * util + rng.gauss(0.0, 0.5), 1),
            power_watts=round(power, 3),
            sm_clock_hertz=(spec.sm_clock_max_mhz if busy else 345.0) * 1e6,
            memory_clock_hertz=spec.memory_clock_mhz * 1e6,
            ecc_corrected_errors_total=g.ecc_corrected if spec.ecc else None,
            ecc_uncorrected_errors_total=g.ecc_uncorrected if spec.ecc else None,
            process_count=(1 + info.index % 2) if busy else 0,
            xid_errors_total=xids,
            mig=migs,
            gpm=reading,
            **health,
        )
        return judge(sample)

    def _gpm(self, g: _SimGpu, util: float, dt: float) -> GpmReading | None:
        """GPM readings that fit the utilization: SM activity is at most utilization (a
        busy GPU seldom fills every SM), tensor activity is within SM activity, DRAM
        follows memory activity; NVLink and PCIe bytes grow with load. None without GPM
        and on the first poll, as NVML gives (a pair needs two samples)."""
        if not has_gpm(g.spec):
            return None
        if not g.gpm_primed:
            g.gpm_primed = True
            return None
        sm = _floor(util * (0.55 + 0.4 * util))
        links = g.spec.nvlink_links or 0
        rates = {("pcie", "tx"): 2048.0 * util, ("pcie", "rx"): 3072.0 * util}
        if links:  # MiB/s: ~1 GiB/s per link per unit of load, a little less read
            rates |= {
                ("nvlink", "tx"): 1024.0 * links * util,
                ("nvlink", "rx"): 900.0 * links * util,
            }
        g.gpm_counters.add(rates, dt)
        ratios = {
            "sm_active_ratio": sm,
            "sm_occupancy_ratio": _floor(sm * 0.5),
            "tensor_active_ratio": _floor(sm * 0.7),
            "dram_active_ratio": _floor(min(1.0, util * 0.6 * 0.9)),
            "fp64_active_ratio": _floor(sm * 0.02),
        }
        return gpm.reading(ratios, g.gpm_counters)


def _floor(v: float) -> float:
    """Rounded down to 4 places, so a reading derived from another never passes it."""
    return math.floor(v * 1e4) / 1e4


def _mig_gpm(r: GpmReading | None, k: int) -> GpmReading | None:
    """A GPU instance's share of the GPU's activity: its own ratios, each at most the
    GPU's (instance k is a little less busy than k-1); no byte counters per instance."""
    if r is None:
        return None
    f = 1.0 - 0.1 * (k % 4)

    def part(v: float | None) -> float | None:
        return None if v is None else _floor(v * f)

    return GpmReading(
        sm_active_ratio=part(r.sm_active_ratio),
        sm_occupancy_ratio=part(r.sm_occupancy_ratio),
        tensor_active_ratio=part(r.tensor_active_ratio),
        dram_active_ratio=part(r.dram_active_ratio),
        fp64_active_ratio=part(r.fp64_active_ratio),
    )
