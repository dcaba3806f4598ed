"""Leader identities are unique (issue 28): two rebalancer replicas on one hostname with no
$POD_NAME both led. The default leader identity is `<$POD_NAME or hostname>_<UUID>`, one
UUID per process, as client-go makes it; an explicit `kubernetes.holder_identity` (or
`--identity`) is used as it is. The environment is read in one place, config; the agent's
node Lease holder stays `<holder_identity>/<pid>`. Two real processes on one host against
a real kube-apiserver: tests/integration/rebalancer/test_identity.py."""

from __future__ import annotations

import re
import socket
from typing import Any

import pytest

from gpudaemon import cli
from gpudaemon.config import PROCESS_UUID, load_config

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


@pytest.fixture(autouse=True)
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "host-a")


@pytest.mark.parametrize(
    ("environ", "overrides", "holder", "leader"),
    [
        ({}, {}, "host-a", rf"host-a_{UUID}"),
        ({"POD_NAME": "rb-0"}, {}, "rb-0", rf"rb-0_{UUID}"),
        ({"GPUDAEMON_KUBERNETES__HOLDER_IDENTITY": "me"}, {}, "me", "me"),
        ({"POD_NAME": "rb-0"}, {"kubernetes": {"holder_identity": " me "}}, "me", "me"),
        ({}, {"kubernetes": {"leader_identity": "lead"}}, "host-a", "lead"),
    ],
)
def test_the_leader_identity_is_unique_unless_set(
    environ: dict[str, str], overrides: dict[str, Any], holder: str, leader: str
) -> None:
    k = load_config(environ=environ, overrides=overrides).kubernetes
    assert k.holder_identity == holder
    assert re.fullmatch(leader, k.leader_identity), k.leader_identity


def test_one_process_names_one_leader_and_another_process_another() -> None:
    a, b = load_config(environ={}), load_config(environ={})
    assert a == b and a.kubernetes.leader_identity == f"host-a_{PROCESS_UUID}"


def test_rebalance_takes_its_identity_from_config_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--identity` is an explicit holder_identity; without it, $POD_NAME read by config
    gets the suffix (cli.py read $POD_NAME itself, ignoring kubernetes.holder_identity)."""
    seen: list[str] = []

    class Stub:
        def __init__(self, cfg: Any, identity: str) -> None:
            seen.append(identity)
            self.stop_event = type("E", (), {"set": lambda self: None})()

        def run(self) -> int:
            return 0

    import gpudaemon.rebalancer.app as app

    monkeypatch.setattr(app, "Rebalancer", Stub)
    monkeypatch.setenv("POD_NAME", "rb-0")
    monkeypatch.delenv("GPUDAEMON_KUBERNETES__HOLDER_IDENTITY", raising=False)
    assert cli.main(["rebalance", "--identity", "given"]) == 0
    assert cli.main(["rebalance"]) == 0
    monkeypatch.setenv("GPUDAEMON_KUBERNETES__HOLDER_IDENTITY", "from-env")
    assert cli.main(["rebalance"]) == 0
    assert seen[0] == "given" and seen[2] == "from-env"
    assert re.fullmatch(rf"rb-0_{UUID}", seen[1]), seen
