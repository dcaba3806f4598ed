"""A real etcd + kube-apiserver for the session, with the agent's RBAC and admission
policy applied from deploy/manifests/ (exactly the files the chart ships)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.kube.controlplane import ADMISSION, RBAC, ControlPlane


@pytest.fixture(scope="session")
def control_plane(tools_bin: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(tools_bin)
    try:
        cp.start()
        cp.apply_manifest(RBAC)
        cp.apply_manifest(ADMISSION)
        cp.wait_for_policy()
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def node(control_plane: ControlPlane) -> str:
    """A fresh Node (no kubelet: a plain object) carrying someone else's labels."""
    name = f"gpu-{uuid.uuid4().hex[:8]}"
    control_plane.create_node(name, {"team": "ml", "example.com/rack": "r12"})
    return name
