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


class GpuLostError(BackendError):
    """One GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)."""

    def __init__(self, index: int, detail: str = "GPU is lost") -> None:
        super().__init__(f"GPU {index}: {detail}")
        self.index = index


class SinkError(GpudaemonError):
    """A label/annotation output could not be written."""
