"""Our own error types. Library exceptions are wrapped at each boundary into these,
so the rest of the code never sees pynvml, kubernetes or influxdb_client errors."""

import json
from typing import Literal


class GpudaemonError(Exception):
    """Base for every error we raise on purpose.

    `reported` True: the raiser already logged it (one line when a problem starts, one
    when it ends, e.g. the Node sink during an outage); the agent's job wrapper then
    only counts it.
    """

    reported = False


class UsageError(GpudaemonError):
    """Bad input from the user: printed as one line, exit code 2."""


class ConfigError(UsageError):
    """The configuration file, environment or flags are invalid."""


class ProfileError(UsageError):
    """A simulated-GPU profile is unknown or malformed."""


class CronError(ValueError):
    """A cron expression that does not parse (a ValueError, so config validation
    reports it against its key)."""


class BackendError(GpudaemonError):
    """A GPU backend failed in a way that affects the whole node."""


class NvmlUnavailableError(BackendError, UsageError):
    """NVML cannot be loaded (no library, no driver): a usage problem on this host."""


class PodResourcesError(GpudaemonError):
    """The kubelet pod-resources socket is there but List failed."""


class SinkError(GpudaemonError):
    """A label/annotation output could not be written."""


class HistoryError(GpudaemonError):
    """InfluxDB history could not be written or spooled."""


class InfluxWriteError(HistoryError):
    """One write to InfluxDB failed; `kind` is the metric label (unauthorized,
    unreachable, timeout, rejected, server)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class SpoolError(HistoryError):
    """The on-disk spool could not be opened, written or read. `reason` is the OS's
    words (e.g. "Read-only file system"), for messages that name the path themselves."""

    def __init__(self, detail: str, reason: str = "") -> None:
        super().__init__(detail)
        self.reason = reason or detail


class SpoolLockedError(SpoolError):
    """Another process holds the spool directory's lock."""


class BadValueError(GpudaemonError, ValueError):
    """A value another program wrote (a Node's annotation or label) that is over its
    size cap, nested deeper than its schema, or not of its schema. The one error the
    bounded decoders raise: the reader treats that object as having no data, counts it
    and logs it once; it never escapes a watch or a list. `key` names the value (the
    metric label), `reason` says what is wrong in a few words."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class KubeError(GpudaemonError):
    """The Kubernetes API server refused or failed a request. `status` is the HTTP
    status when there was one (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeUnavailableError(KubeError):
    """No usable answer: connection refused, timeout, 429 or 5xx. Worth retrying."""


class KubeForbiddenError(KubeError):
    """401/403: the identity lacks the RBAC (or admission) to do this."""


class KubeNotFoundError(KubeError):
    """404: e.g. the agent's own Node does not exist (it never creates one)."""


class KubeConflictError(KubeError):
    """409: a conflicting write."""


class KubeGoneError(KubeError):
    """410: a watch's resourceVersion is too old; list again, then watch from there."""


class KubeInvalidError(KubeError):
    """400/422 and other 4xx: the server rejected the request (a bug, or an admission
    policy); retrying the same request will not help."""


# -- HTTP failures, shared by every HTTP client (Kubernetes, InfluxDB) ------------------

HttpFailureKind = Literal[
    "unauthorized", "not_found", "conflict", "gone", "rejected", "unavailable"
]


def http_failure_kind(status: int | None) -> HttpFailureKind:
    """The one mapping from an HTTP status to what it means for the caller. 429 and 5xx
    (and no status) are "unavailable": try again later; other 4xx are "rejected"."""
    if status in (401, 403):
        return "unauthorized"
    if status == 404:
        return "not_found"
    if status == 409:
        return "conflict"
    if status == 410:
        return "gone"
    if status is not None and 400 <= status < 500 and status != 429:
        return "rejected"
    return "unavailable"


def server_message(body: bytes | str | None, limit: int = 300) -> str:
    """The server's own words from an error body: the JSON `message` (Kubernetes,
    InfluxDB 2.x) or `error` (InfluxDB 1.x), else the text; one line, bounded."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            text = str(parsed.get("message") or parsed.get("error") or text)
    except ValueError:
        pass
    return " ".join(text.split())[:limit]


def root_cause(e: BaseException) -> BaseException:
    """urllib3 wraps the real cause (refused, timed out, DNS) in MaxRetryError and
    friends; return the innermost `reason`."""
    seen = 0
    while seen < 5 and isinstance(getattr(e, "reason", None), BaseException):
        e = e.reason  # type: ignore[attr-defined]
        seen += 1
    return e
