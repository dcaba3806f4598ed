"""The API server goes away under the extender and comes back (its own control plane:
this module's `rig`): the extender keeps answering from what it last saw, its watches
reconnect with backoff by themselves, and what changed meanwhile reaches its caches."""

from __future__ import annotations

import json
import urllib.request
import uuid

import pytest

from tests.integration.scheduler.rig import SchedulerRig
from tests.support import wait_for

pytestmark = pytest.mark.integration


def test_the_extender_rides_out_an_api_server_restart(rig: SchedulerRig) -> None:
    ext = rig.extender
    assert ext is not None
    group = uuid.uuid4().hex[:6]
    first, later = f"{group}-a", f"{group}-b"
    rig.add_node(first, group)
    rig.run_agents([first])
    rig.wait_extender_sees([first])

    broken = {id(r): r.relists for r in ext.reflectors}
    rig.cp.stop_apiserver()
    try:
        wait_for(
            lambda: all(r.relists > broken[id(r)] for r in ext.reflectors),
            timeout=60,
            what="every watch broken and backing off",
        )
        # Still ready, still judging from the last state it saw: the scheduler (which
        # also cannot bind now) gets answers, not errors, for the pods it holds.
        assert ext.ready() == (True, "ok")
        body = json.dumps(
            {
                "Pod": {
                    "metadata": {"name": "p", "uid": ""},
                    "spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}]},
                },
                "NodeNames": [first],
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{ext.server.port}/filter", data=body, method="POST"
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["NodeNames"] == [first]
    finally:
        rig.cp.start_apiserver()

    # Made after the restart: reaches the extender only through a re-established watch.
    rig.add_node(later, group)
    rig.run_agents([later])
    wait_for(
        lambda: (s := ext.cluster.states([later])[later]) is not None and s.has_agent_labels,
        timeout=90,
        interval=0.2,
        what="the extender's caches to see a Node labelled after the restart",
    )
    rig.wait_extender_sees([first, later])
    name = rig.create_pod(8, group, selector={"kubernetes.io/hostname": later})
    assert rig.wait_bound(name, timeout=60) == later
    rig.delete_pods([name])
