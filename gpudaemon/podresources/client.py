"""The one module that talks to the kubelet pod-resources API (v1 `List`).

One unary gRPC call over the kubelet's unix socket, spoken with h2 (HTTP/2) and the
generated protobuf messages, not grpcio: grpc's core costs ~8.5 MiB of RSS (measured,
docs/benchmarks.md), a tenth of the agent's budget, for one call every 10 s. Failures,
including a gRPC status other than OK, become PodResourcesError here. The messages are
imported at the first call, that is once the socket is there.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpudaemon.errors import PodResourcesError
from gpudaemon.model import PodMap, PodRef

LIST_PATH = "/v1.PodResourcesLister/List"
# A kubelet's answer for ~110 pods is a few KiB; anything near this is not a kubelet.
MAX_RESPONSE_BYTES = 16 << 20
_STATUS = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}  # fmt: skip

# nvidia.com/gpu carries GPU UUIDs (or MIG UUIDs with the "single" MIG strategy);
# the "mixed" strategy names one resource per MIG profile, nvidia.com/mig-1g.10gb.
GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# A device a container holds through a ResourceClaim is named by DRA: (driver, pool,
# device). The agent's ResourceSlice index turns ours into the GPU or MIG UUID.
DraResolver = Callable[[str, str, str], str | None]
DRA_RESOURCE = "dra:gpu.nvidia.com"  # the `resource` of an assignment made through DRA
# The kubelet answers List from memory; a slow answer means it is in trouble.
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Assignment:
    """One device id assigned to one container."""

    device_id: str
    resource: str
    ref: PodRef


def list_pod_resources(
    socket_path: str, timeout_s: float = DEFAULT_TIMEOUT_S, dra: DraResolver | None = None
) -> list[Assignment]:
    """Call List once on a fresh connection and flatten the answer to GPU assignments:
    device-plugin devices, and with `dra` the devices of containers' ResourceClaims."""
    from gpudaemon.podresources._gen import api_pb2

    request = api_pb2.ListPodResourcesRequest().SerializeToString()
    try:
        payload = _unary_call(socket_path, LIST_PATH, request, timeout_s)
        resp = api_pb2.ListPodResourcesResponse.FromString(payload)
    except _GrpcError as e:
        raise PodResourcesError(f"pod-resources List on {socket_path}: {e}") from None
    except Exception as e:  # a malformed message: DecodeError and kin
        raise PodResourcesError(
            f"pod-resources List on {socket_path}: INTERNAL: bad response: {e}"
        ) from None
    return list(_assignments(resp.pod_resources, dra))


class _GrpcError(Exception):
    """`CODE: detail`, as grpc names them."""


def _unary_call(socket_path: str, path: str, request: bytes, timeout_s: float) -> bytes:
    """One unary gRPC call over HTTP/2 on a unix socket: the response message's bytes."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions

    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as e:
        raise _GrpcError(f"UNAVAILABLE: {e}") from None
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except TimeoutError:
            raise _GrpcError("DEADLINE_EXCEEDED: connect timed out") from None
        except OSError as e:
            raise _GrpcError(f"UNAVAILABLE: {e.strerror or e}") from None
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("grpc-timeout", f"{max(1, int(timeout_s * 1000))}m"),
                ("user-agent", "gpudaemon"),
            ],
        )
        conn.send_data(stream, struct.pack(">BI", 0, len(request)) + request, end_stream=True)
        sock.sendall(conn.data_to_send())
        body = bytearray()
        status: str | None = None
        message = ""
        ended = False
        while not ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _GrpcError("DEADLINE_EXCEEDED: no answer in time")
            sock.settimeout(left)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                raise _GrpcError("DEADLINE_EXCEEDED: no answer in time") from None
            except OSError as e:
                raise _GrpcError(f"UNAVAILABLE: {e.strerror or e}") from None
            if not data:
                raise _GrpcError("UNAVAILABLE: the kubelet closed the connection")
            try:
                events = conn.receive_data(data)
            except h2.exceptions.ProtocolError as e:
                raise _GrpcError(f"INTERNAL: HTTP/2: {e}") from None
            for ev in events:
                if isinstance(ev, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    headers = _headers(ev.headers or [])
                    if headers.get(":status", "200") != "200":
                        raise _GrpcError(f"UNAVAILABLE: HTTP status {headers[':status']}")
                    if "grpc-status" in headers:
                        status = headers["grpc-status"]
                        message = headers.get("grpc-message", "")
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == stream:
                    body += ev.data or b""
                    if len(body) > MAX_RESPONSE_BYTES:
                        raise _GrpcError("RESOURCE_EXHAUSTED: response over 16 MiB")
                    conn.acknowledge_received_data(ev.flow_controlled_length, stream)
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == stream:
                    ended = True
                elif isinstance(ev, h2.events.StreamReset | h2.events.ConnectionTerminated):
                    raise _GrpcError("UNAVAILABLE: the kubelet reset the call")
            out = conn.data_to_send()
            if out:
                sock.sendall(out)
    finally:
        sock.close()
    if status is None:
        raise _GrpcError("INTERNAL: the answer carried no grpc-status")
    if status != "0":
        code = _STATUS.get(int(status) if status.isdigit() else -1, "UNKNOWN")
        raise _GrpcError(f"{code}: {_unescape(message)}")
    if len(body) < 5:
        raise _GrpcError("INTERNAL: the answer carried no message")
    flag, size = struct.unpack(">BI", bytes(body[:5]))
    if flag != 0 or size != len(body) - 5:
        raise _GrpcError("INTERNAL: a compressed or malformed message")
    return bytes(body[5:])


def _headers(pairs: Iterable[Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (
            v.decode() if isinstance(v, bytes) else str(v)
        )
        for k, v in pairs
    }


def _unescape(message: str) -> str:
    """grpc-message is percent-encoded."""
    from urllib.parse import unquote

    return unquote(message)


def _assignments(pods: Iterable[Any], dra: DraResolver | None = None) -> Iterable[Assignment]:
    """From api_pb2.PodResources messages."""
    for pod in pods:
        for ctr in pod.containers:
            if dra is not None:
                ref = PodRef(pod=pod.name, namespace=pod.namespace, container=ctr.name)
                yield from _dra_assignments(ctr.dynamic_resources, dra, ref)
            for dev in ctr.devices:
                if not is_gpu_resource(dev.resource_name):
                    continue
                for raw in dev.device_ids:
                    yield Assignment(
                        device_id=_physical_id(raw),
                        resource=dev.resource_name,
                        ref=PodRef(pod=pod.name, namespace=pod.namespace, container=ctr.name),
                    )


def _dra_assignments(claims: Iterable[Any], dra: DraResolver, ref: PodRef) -> Iterable[Assignment]:
    """The devices of a container's claims that are GPUs or MIG devices of ours (a MIG
    device's UUID is its own, as the device plugin's "single"/"mixed" ids are, so it
    lands on its MIG series the same way)."""
    for claim in claims:
        for res in claim.claim_resources:
            if not res.device_name:
                continue
            uuid = dra(res.driver_name, res.pool_name, res.device_name)
            if uuid:
                yield Assignment(device_id=uuid, resource=DRA_RESOURCE, ref=ref)


def is_gpu_resource(name: str) -> bool:
    return name == GPU_RESOURCE or name.startswith(MIG_RESOURCE_PREFIX)


def _physical_id(device_id: str) -> str:
    # With time-slicing the device plugin advertises replicas as "GPU-<uuid>::<n>".
    return device_id.split("::", 1)[0]


def device_map(assignments: Iterable[Assignment]) -> PodMap:
    """GPU/MIG UUID -> container. A shared (time-sliced) GPU goes to the first container
    in namespace/pod/container order, so the label does not flap between scrapes."""
    out: dict[str, PodRef] = {}
    for a in sorted(
        assignments, key=lambda a: (a.ref.namespace, a.ref.pod, a.ref.container, a.device_id)
    ):
        out.setdefault(a.device_id, a.ref)
    return out
