"""Our own error types. Library exceptions are wrapped at each boundary into these,
so the rest of the code never sees pynvml, kubernetes or influxdb_client errors."""


class GpudaemonError(Exception):
    """Base for every error we raise on purpose."""


class UsageError(GpudaemonError):
    """Bad input from the user: printed as one line, exit code 2."""


class ConfigError(UsageError):
    """The configuration file, environment or flags are invalid."""


class ProfileError(UsageError):
    """A simulated-GPU profile is unknown or malformed."""


class BackendError(GpudaemonError):
    """A GPU backend failed in a way that affects the whole node."""


class NvmlUnavailableError(BackendError, UsageError):
    """NVML cannot be loaded (no library, no driver): a usage problem on this host."""


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


class APIError(SinkError):
    """The Kubernetes API server refused or failed a request (kopf's naming)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class APIUnavailableError(APIError):
    """No usable answer: connection refused, timeout, 429 or 5xx. Worth retrying."""


class APIForbiddenError(APIError):
    """401/403: the identity lacks the RBAC (or admission) to do this."""


class APINotFoundError(APIError):
    """404: e.g. the agent's own Node does not exist (it never creates one)."""


class APIConflictError(APIError):
    """409: a conflicting write."""


class APIInvalidError(APIError):
    """400/422: the server rejected the object (a bug, or an admission policy)."""
