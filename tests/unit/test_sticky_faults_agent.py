"""A GPU that hit XID 79 stays unhealthy across agent restarts on the same boot, as the
agent runs it against the API server: the record rides on the Node as the
`gpu-faults` annotation, read back before the first poll. On the sink's fake API
server; the real one is tests/integration/kube/test_sticky_faults.py."""

from __future__ import annotations

import json
from typing import Any

from gpudaemon.agent.app import Agent
from gpudaemon.backends.simulated import SimulatedBackend, load_profile
from gpudaemon.config import load_config
from tests.clock import FakeClock
from tests.unit.test_kube import FakeClient, P, make


def profile(tmp_path: Any, *, fault: bool, boot: str) -> str:
    doc = {
        "boot_id": boot,
        "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559,
                  "compute_capability": "9.0", "count": 2}],
        "faults": [{"kind": "xid", "gpu": 1, "xid": 79}] if fault else [],
    }  # fmt: skip
    path = tmp_path / "node.yaml"  # one file: the same simulated GPUs (UUIDs) each time
    path.write_text(json.dumps(doc))
    return str(path)


def agent_on(fake: FakeClient, simulate: str) -> Agent:
    cfg = load_config(environ={}, overrides={"node_name": "n1", "simulate": simulate})
    sink, _, _, _ = make()
    sink.client = fake
    sink.lease.client = fake  # type: ignore[assignment]
    clock = FakeClock()
    agent = Agent(
        cfg,
        backend=SimulatedBackend(load_profile(simulate), clock=clock),
        label_sink=sink,
        clock=clock,
    )
    sink.set_freshness(lambda: True)
    agent.read_back_faults()
    return agent


def test_an_xid_survives_a_restart_and_a_new_boot_id_clears_it(tmp_path: Any) -> None:
    fake = FakeClient()
    first = agent_on(fake, profile(tmp_path, fault=True, boot="b1"))
    assert first.run_once()
    assert fake.labels[P + "gpu.unhealthy"] == "1"
    record = json.loads(fake.annotations[P + "gpu-faults"])
    assert next(iter(record["gpus"].values()))["reason"] == "xid 79"
    first.close()

    # Restarted on the same boot; the simulated GPU no longer reports the fault.
    again = agent_on(fake, profile(tmp_path, fault=False, boot="b1"))
    assert again.run_once()
    assert fake.labels[P + "gpu.unhealthy"] == "1"
    assert fake.conditions["GPUHealthy"]["status"] == "False"
    assert "GPU 1: xid 79" in fake.conditions["GPUHealthy"]["message"]
    gpus = json.loads(fake.annotations[P + "gpus"])
    assert gpus != [] and P + "gpu-faults" in fake.annotations
    again.close()

    # The node rebooted (a new boot ID): every GPU was reset.
    rebooted = agent_on(fake, profile(tmp_path, fault=False, boot="b2"))
    assert rebooted.run_once()
    assert fake.labels[P + "gpu.unhealthy"] == "0"
    assert fake.conditions["GPUHealthy"]["status"] == "True"
    assert P + "gpu-faults" not in fake.annotations
    rebooted.close()


def test_a_failed_read_back_is_seeded_by_the_first_reconcile(tmp_path: Any) -> None:
    from gpudaemon.errors import KubeError

    fake = FakeClient()
    first = agent_on(fake, profile(tmp_path, fault=True, boot="b1"))
    assert first.run_once()
    first.close()
    fake.fail = KubeError("connection refused", None)
    again = agent_on(fake, profile(tmp_path, fault=False, boot="b1"))
    fake.fail = None
    again.run_once()
    again.run_once()  # the first write may miss it; it is never dropped from memory
    assert fake.labels[P + "gpu.unhealthy"] == "1"
    assert P + "gpu-faults" in fake.annotations
    again.close()


def test_a_hand_edited_record_is_one_error_line_not_a_crash(
    tmp_path: Any, lines: list[tuple[str, str]]
) -> None:
    fake = FakeClient()
    fake.annotations[P + "gpu-faults"] = "{not json"
    agent = agent_on(fake, profile(tmp_path, fault=False, boot="b1"))
    assert agent.run_once()
    assert any("cannot read the GPU fault record" in m for lvl, m in lines if lvl == "ERROR")
    assert fake.labels[P + "gpu.unhealthy"] == "0"
    agent.close()
