"""Pod attribution against a real gRPC server speaking the kubelet pod-resources v1
proto: GPU and MIG device ids map to pod/namespace/container, and only the assigned
GPU's series carry them, in-process and in a real `gpudaemon run`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.agent.cache import Cache
from gpudaemon.agent.metrics.collector import GpuCollector
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.model import PodRef
from gpudaemon.podresources import PodAttribution, PodResourcesError, list_pod_resources
from gpudaemon.podresources.client import device_map
from tests.integration.podresources.fake_kubelet import KubeletServer, pod
from tests.support import free_port, http_get, start_agent, stop, wait_for

pytestmark = pytest.mark.integration


def test_list_maps_gpu_and_mig_ids_and_ignores_other_resources(kubelet: KubeletServer) -> None:
    kubelet.servicer.pods = [
        pod("train-0", "ml", ("trainer", {"nvidia.com/gpu": ["GPU-aaa"]})),
        pod("infer-1", "serving", ("server", {"nvidia.com/mig-1g.10gb": ["MIG-bbb"]})),
        pod("shared", "ml", ("a", {"nvidia.com/gpu": ["GPU-ccc::1"]})),
        pod("nic", "net", ("c", {"example.com/nic": ["eth1"]})),
    ]
    m = device_map(list_pod_resources(str(kubelet.socket)))
    assert dict(m) == {
        "GPU-aaa": PodRef("train-0", "ml", "trainer"),
        "MIG-bbb": PodRef("infer-1", "serving", "server"),
        "GPU-ccc": PodRef("shared", "ml", "a"),  # time-slicing replica suffix stripped
    }


def test_a_missing_socket_means_no_attribution_and_one_log_line(short_tmp: Path) -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO")
    try:
        attr = PodAttribution(str(short_tmp / "absent.sock"))
        for _ in range(3):
            attr.refresh()
    finally:
        logger.remove(sink)
    assert attr.get() == {}
    assert sum("pod attribution off" in line for line in lines) == 1


def test_a_failing_kubelet_raises_our_error_and_keeps_the_last_map(
    kubelet: KubeletServer,
) -> None:
    kubelet.servicer.pods = [pod("p", "ns", ("c", {"nvidia.com/gpu": ["GPU-1"]}))]
    attr = PodAttribution(str(kubelet.socket), timeout_s=0.5)
    attr.refresh()
    kubelet.servicer.fail = True
    with pytest.raises(PodResourcesError, match="INTERNAL: kubelet is unwell"):
        attr.refresh()
    assert attr.get() == {"GPU-1": PodRef("p", "ns", "c")}


def test_scrape_reads_the_refreshed_map_without_calling_the_kubelet(
    kubelet: KubeletServer,
) -> None:
    backend = SimulatedBackend(load_profile("a100-mig"), seed=0)
    inv = backend.inventory()
    gpu3, mig = inv.gpus[3], inv.gpus[5].mig_devices[2]
    kubelet.servicer.pods = [
        pod("train", "ml", ("main", {"nvidia.com/gpu": [gpu3.uuid]})),
        pod("infer", "serving", ("srv", {"nvidia.com/mig-1g.10gb": [mig.uuid]})),
    ]
    cache = Cache()
    cache.put_inventory(inv)
    cache.put_samples(backend.sample())
    attr = PodAttribution(str(kubelet.socket))
    attr.refresh()
    reg = CollectorRegistry()
    reg.register(GpuCollector(cache, "n", pods=attr.get))
    calls = kubelet.servicer.calls
    fams = {f.name: f for f in reg.collect()}
    assert kubelet.servicer.calls == calls  # the scrape did not call List

    healthy = fams["gpudaemon_gpu_healthy"].samples
    owned = [s for s in healthy if s.labels["pod"]]
    assert [(s.labels["gpu"], s.labels["pod"], s.labels["container"]) for s in owned] == [
        ("3", "train", "main")
    ]
    migs = fams["gpudaemon_mig_memory_total_bytes"].samples
    owned_migs = [s for s in migs if s.labels["pod"]]
    assert [(s.labels["mig_uuid"], s.labels["namespace"]) for s in owned_migs] == [
        (mig.uuid, "serving")
    ]


def test_a_running_agent_labels_only_the_assigned_gpu_series(
    kubelet: KubeletServer, short_tmp: Path
) -> None:
    inv = SimulatedBackend(load_profile("dgx-h100"), seed=0).inventory()
    target = inv.gpus[2].uuid
    kubelet.servicer.pods = [pod("llm-0", "research", ("worker", {"nvidia.com/gpu": [target]}))]
    cfg = short_tmp / "cfg.yaml"
    cfg.write_text(
        "schedules: {telemetry: '* * * * * *', pods: '* * * * * *'}\n"
        f"metrics: {{pod_resources_socket: '{kubelet.socket}'}}\n"
    )
    port = free_port()
    proc = start_agent(
        [
            "run",
            "--config",
            str(cfg),
            "--simulate",
            "dgx-h100",
            "--seed",
            "0",
            "--listen",
            f"127.0.0.1:{port}",
            "--node-name",
            "node-x",
            "--labels-to",
            str(short_tmp / "labels.json"),
        ],
        log=short_tmp / "agent.log",
    )
    try:

        def attributed() -> str | None:
            b = http_get(f"http://127.0.0.1:{port}/metrics")[1].decode()
            return b if 'pod="llm-0"' in b else None

        body = wait_for(attributed, timeout=20, what="pod labels on /metrics")
    finally:
        assert stop(proc) == 0, (short_tmp / "agent.log").read_text()
    power = [ln for ln in body.splitlines() if ln.startswith("gpudaemon_gpu_power_watts{")]
    assert len(power) == 8
    owned = [ln for ln in power if 'pod="llm-0"' in ln]
    assert len(owned) == 1
    assert f'uuid="{target}"' in owned[0]
    assert 'namespace="research"' in owned[0] and 'container="worker"' in owned[0]
    others = [ln for ln in power if ln not in owned]
    assert others and all(re.search(r'pod=""', ln) for ln in others)


def test_an_answer_larger_than_the_http2_window_arrives_whole(kubelet: KubeletServer) -> None:
    """HTTP/2 flow control: 3,000 pods are ~300 KiB, several 64 KiB windows, so the
    client must grant more as it reads (a real gRPC server enforces it)."""
    kubelet.servicer.pods = [
        pod(f"pod-{i:05d}-{'x' * 40}", "ml", ("c", {"nvidia.com/gpu": [f"GPU-{i:08d}"]}))
        for i in range(3000)
    ]
    got = list_pod_resources(str(kubelet.socket))
    assert len(got) == 3000 and got[-1].device_id == "GPU-00002999"


def test_a_kubelet_that_never_answers_is_a_deadline_not_a_hang(short_tmp: Path) -> None:
    import socket

    path = short_tmp / "silent.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen(1)  # accepts, reads nothing, answers nothing
        with pytest.raises(PodResourcesError, match="DEADLINE_EXCEEDED"):
            list_pod_resources(str(path), timeout_s=0.5)


def test_something_that_is_not_a_kubelet_is_one_error(short_tmp: Path) -> None:
    import socket
    import threading

    path = short_tmp / "http1.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen(1)

        def answer() -> None:
            c, _ = s.accept()
            c.recv(1024)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            c.close()

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(PodResourcesError, match="pod-resources List on"):
            list_pod_resources(str(path), timeout_s=2)
