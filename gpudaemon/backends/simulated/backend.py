"""SimulatedBackend: the Backend over a Profile: builds the GPUs (UUIDs from the seed,
MIG devices from the profile tables), applies MIG layout changes, takes each step's
samples and charges their NVML cost as CPU time."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
import uuid as uuidlib
from collections.abc import Callable

from gpudaemon.backends import migprofiles
from gpudaemon.backends.base import ENERGY_CALLS, GPM_CALLS, GPM_MIG_CALLS, SAMPLE_CALLS
from gpudaemon.backends.simulated.effects import fire_faults, record_xid
from gpudaemon.backends.simulated.effects import reset as reset_state
from gpudaemon.backends.simulated.events import SimEventSet
from gpudaemon.backends.simulated.faults import FaultSpec
from gpudaemon.backends.simulated.profile import GpuSpec, Profile, mig_layout_error
from gpudaemon.backends.simulated.readings import SimGpu, _cost_s, _health_cost_s, sample_gpu
from gpudaemon.backends.xidevents import XidListener, XidListeners, xid_event_loop
from gpudaemon.errors import ProfileError
from gpudaemon.health import signals
from gpudaemon.model import MIB, GpuInfo, GpuSample, MigDevice, NodeInventory
from gpudaemon.remediation.nvsmi import EXIT_CODES, ToolResult

# What a GPU reset takes on a simulated GPU (an H100's is a few seconds with the tool).
SIM_RESET_S = 1.0


def _spend(seconds: float, start: float | None = None) -> None:
    """Take `seconds` of wall time from `start` (default: now) the way an NVML call
    does: on the CPU. A `start` in the past counts the simulator's own work since then
    towards it. Sleeps only the part of a long wait that a sleep's overshoot cannot
    spoil."""
    end = (time.perf_counter() if start is None else start) + seconds
    seconds = end - time.perf_counter()
    if seconds <= 0.0:
        return
    if seconds > 0.002:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


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
        # XID events (`subscribe`): the simulator's event set, run by the same loop as
        # NVML's, on a thread that starts with the first listener.
        self._listeners = XidListeners()
        self._events: SimEventSet | None = None
        self._stop = threading.Event()
        self._event_thread: threading.Thread | None = None

    def boot_id(self) -> str:
        return self.profile.boot_id

    def _build(self) -> list[SimGpu]:
        gpus: list[SimGpu] = []
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
                    SimGpu(
                        info=info,
                        spec=spec,
                        faults=faults,
                        walk=spec.utilization.mean,
                        rng=random.Random(f"{self.seed}:{index}"),
                        sample_cost_s=_cost_s(spec, SAMPLE_CALLS),
                        overhead_s=spec.sample_overhead_us / 1e6,
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
            started = time.perf_counter()
            now = self._clock()
            dt = max(0.0, now - self._last)
            self._last = now
            self._polls += 1
            elapsed = now - self._start
            self._apply_mig_changes(elapsed)
            out = tuple(self._sample_one(g, elapsed, dt) for g in self._gpus)
            # What a real sample costs, the simulator's own computing included.
            _spend(sum(g.cost_s() for g in self._gpus if not g.lost), started)
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
        self._stop.set()
        if self._event_thread is not None:
            self._event_thread.join(timeout=3)

    def reset_gpu(self, index: int, tool: str, timeout_s: float) -> ToolResult:
        """A reset as the tool gives it, on the simulated GPU (`faults.reset`); `tool`
        is not run: the simulator is the driver here. A lost GPU does not come back."""
        time.sleep(min(SIM_RESET_S, timeout_s))
        with self._lock:
            if not 0 <= index < len(self._gpus):
                return ToolResult(False, False, 6, f"exit 6 ({EXIT_CODES[6]})")
            g = self._gpus[index]
            if g.lost:
                return ToolResult(False, False, 15, f"exit 15 ({EXIT_CODES[15]})")
            reset_state(g)
            if self._events is not None:
                self._events.kick()  # a persistent XID fault fires again now
        return ToolResult(True, False, 0, f"GPU {g.info.pci_bus_id} was successfully reset.")

    # -- XID events --------------------------------------------------------------

    def subscribe(self, listener: XidListener) -> None:
        """Tell `listener(index, xid)` of every XID when it happens. From the first
        listener on, XID faults are driver events through the NVML event loop (as on
        a GPU node) instead of counts taken by the next sample."""
        self._listeners.add(listener)
        with self._lock:
            if self._events is not None:
                return
            self._events = SimEventSet(len(self._gpus), self._release_due_xids)
        self._event_thread = threading.Thread(
            target=xid_event_loop,
            args=(self._events, self._events.handles, self._stop, self.record_xid),
            name="sim-xid-events",
            daemon=True,
        )
        self._event_thread.start()

    def record_xid(self, index: int, xid: int) -> None:
        """Count one XID (called by the event loop), then tell the listeners."""
        with self._lock:
            if 0 <= index < len(self._gpus):
                record_xid(self._gpus[index], xid)
        self._listeners.tell(index, xid)

    def _release_due_xids(self) -> float | None:
        """Post the XID faults whose time has come (those that wait for no poll); the
        seconds until the next one, None when none is queued."""
        events = self._events
        if events is None:
            return None
        with self._lock:
            elapsed = self._clock() - self._start
            soonest: float | None = None
            for g in self._gpus:
                keep = []
                for f in g.faults:
                    if f.kind != "xid" or (f.after_polls and self._polls <= f.after_polls):
                        keep.append(f)
                    elif f.after_s <= elapsed:
                        events.post(g.info.index, f.xid, f.count)
                        if f.persistent:
                            g.persistent.append(f)  # a reset fires it again
                    else:
                        keep.append(f)
                        wait = f.after_s - elapsed
                        soonest = wait if soonest is None else min(soonest, wait)
                g.faults = keep
            return soonest

    # -- test and demo hooks -----------------------------------------------------

    def inject(self, index: int, fault: FaultSpec) -> None:
        """Queue a fault on one GPU; it fires on the next sample that meets its timing."""
        with self._lock:
            self._gpus[index].faults.append(fault)
            if self._events is not None:
                self._events.kick()  # an XID fault due now is an event now

    def _sample_one(self, g: SimGpu, elapsed: float, dt: float) -> GpuSample:
        fire_faults(g, elapsed, self._polls, self._events.post if self._events else None)
        return sample_gpu(g, elapsed, dt)
