"""Pod attribution: which pod/container holds which GPU or MIG instance, read from the
kubelet pod-resources v1 API on its unix socket.

Only `client` talks gRPC; `attribution` turns its answers into the PodMap the metrics
collector reads at scrape time without ever blocking on the kubelet.
"""

from gpudaemon.errors import PodResourcesError
from gpudaemon.podresources.attribution import PodAttribution
from gpudaemon.podresources.client import device_map, list_pod_resources

__all__ = [
    "PodAttribution",
    "PodResourcesError",
    "device_map",
    "list_pod_resources",
]
