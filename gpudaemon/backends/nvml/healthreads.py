"""The health signals NVML gives (issue 30): the cheap reads of every sample (clock
events, remapped rows, the recovery action after XID 154) and the slower health
counters on their own schedule (field values, retired pages, NVLink error counters)."""

from __future__ import annotations

from typing import Any

from loguru import logger

from gpudaemon.backends.base import NVLINK_CALL
from gpudaemon.backends.nvml.library import NvmlLibrary, _field_value, _Lost, _Unsupported
from gpudaemon.health import signals


class HealthReads(NvmlLibrary):
    """The health reads, mixed into NvmlBackend."""

    def _health_readings(self, i: int, h: Any) -> dict[str, Any]:
        """The cheap health calls of every sample (clock events ~2 us, remapped rows,
        estimated ~10 us: docs/benchmarks.md) and the health counters' newest read."""
        out = dict(self._health.get(i, {}))
        mask = self._read(i, "clock events", "nvmlDeviceGetCurrentClocksEventReasons", h)
        if mask is None and (i, "clock events") in self._unsupported:  # drivers before 535
            mask = self._read(
                i, "clock events (old name)", "nvmlDeviceGetCurrentClocksThrottleReasons", h
            )
        if mask is not None:
            out["clock_events_active"] = signals.clock_events(int(mask))
        rows = self._read(i, "remapped rows", "nvmlDeviceGetRemappedRows", h)
        if rows is not None:
            corr, unc, pending, failure = (int(x) for x in rows[:4])
            out.update(
                remapped_rows_correctable=corr,
                remapped_rows_uncorrectable=unc,
                row_remap_pending=bool(pending),
                row_remap_failed=bool(failure),
            )
        with self._xid_lock:
            changed = i in self._recovery_changed
            self._recovery_changed.discard(i)
        if changed:  # XID 154: the driver's recovery action changed; read it now
            action = self._recovery_action(i, h)
            if action is not None:
                out["recovery_action"] = action
                self._health.setdefault(i, {})["recovery_action"] = action
        return out

    def health_counters(self) -> None:
        """The slower health reads, on `schedules.health` (default 30 s): the recovery
        action and clock-event durations (one field-values call), retired pages (before
        Ampere; absent after the first read elsewhere) and the NVLink error counters (4
        calls per active link: 72 on an H100, too many for every sample)."""
        with self._lock:
            self._ensure_init()
            for i, h in enumerate(self._handles):
                if h is None or i in self._lost:
                    continue
                try:
                    self._health[i] = self._health_counters_one(i, h)
                except _Lost:
                    self._mark_lost(i)

    def _health_counters_one(self, i: int, h: Any) -> dict[str, Any]:
        n = self._nvml
        out: dict[str, Any] = {}
        ids = {
            reason: fid
            for reason, const in signals.CLOCK_EVENT_DURATION_FIELDS.items()
            if (fid := getattr(n, const, None)) is not None
        }
        recovery_id = getattr(n, signals.RECOVERY_ACTION_FIELD, signals.RECOVERY_ACTION_FIELD_ID)
        values = self._health_fields(i, h, [recovery_id, *ids.values()])
        if recovery_id in values:
            out["recovery_action"] = signals.recovery_action_name(int(values[recovery_id]))
        seconds = {r: values[fid] / 1e9 for r, fid in ids.items() if fid in values}  # ns
        if seconds:
            out["clock_event_seconds_total"] = seconds
        sbe = self._read(
            i,
            "retired pages sbe",
            "nvmlDeviceGetRetiredPages",
            h,
            getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS", 0),
        )
        dbe = self._read(
            i,
            "retired pages dbe",
            "nvmlDeviceGetRetiredPages",
            h,
            getattr(n, "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR", 1),
        )
        pending = self._read(
            i, "retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", h
        )
        if sbe is not None:
            out["retired_pages_single_bit"] = len(sbe)
        if dbe is not None:
            out["retired_pages_double_bit"] = len(dbe)
        if pending is not None:
            out["retired_pages_pending"] = bool(pending)
        links: dict[int, dict[str, int]] = {}
        for link in self._active_links(i, h):
            counts = {}
            for kind, counter in signals.NVLINK_ERROR_COUNTERS.items():
                v = self._read(i, f"nvlink {link} {kind}", NVLINK_CALL, h, link, counter)
                if v is not None:
                    counts[kind] = int(v)
            if counts:
                links[link] = counts
        if links:
            out["nvlink_errors_total"] = links
        return out

    def _recovery_action(self, i: int, h: Any) -> str | None:
        fid = getattr(self._nvml, signals.RECOVERY_ACTION_FIELD, signals.RECOVERY_ACTION_FIELD_ID)
        v = self._health_fields(i, h, [fid]).get(fid)
        return signals.recovery_action_name(int(v)) if v is not None else None

    def _health_fields(self, i: int, h: Any, ids: list[int]) -> dict[int, float]:
        """nvmlDeviceGetFieldValues for health fields: a field the GPU does not support
        is not asked again (absent, never 0); never with the energy field (~4 ms)."""
        n = self._nvml
        ask = [f for f in ids if (i, f) not in self._unsupported_fields]
        if not ask or (i, "health fields") in self._unsupported:
            return {}
        values = self._read(i, "health fields", "nvmlDeviceGetFieldValues", h, ask)
        out: dict[int, float] = {}
        for v in values or ():
            fid = int(v.fieldId)
            if v.nvmlReturn == n.NVML_ERROR_GPU_IS_LOST:
                raise _Lost()
            if v.nvmlReturn == n.NVML_SUCCESS:
                out[fid] = _field_value(n, v)
            elif v.nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED:
                self._unsupported_fields.add((i, fid))
        return out

    def _active_links(self, i: int, h: Any) -> tuple[int, ...]:
        """The NVLink links that are up, probed once per GPU (up to the inventory's link
        count, else NVML_NVLINK_MAX_LINKS)."""
        known = self._nvlinks.get(i)
        if known is not None:
            return known
        n = self._nvml
        info = self._infos.get(i)
        top = getattr(n, "NVML_NVLINK_MAX_LINKS", signals.NVLINK_MAX_LINKS)
        if info is not None and info.nvlink_links is not None:
            top = min(top, info.nvlink_links)
        up = []
        for link in range(top):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link)
            except _Unsupported:
                break  # no NVLink on this GPU
            except n.NVMLError:
                continue  # this link does not exist
            if int(state) == getattr(n, "NVML_FEATURE_ENABLED", 1):
                up.append(link)
        self._nvlinks[i] = tuple(up)
        if up:
            logger.info("GPU {}: {} NVLink links up; reading their error counters", i, len(up))
        return self._nvlinks[i]
