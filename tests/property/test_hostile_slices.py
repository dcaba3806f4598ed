"""ResourceSlices are another program's objects (issue 32): whatever a forged or broken
slice holds (wrong types at the fields NVIDIA's driver uses, huge strings, deep values),
the agent's slice reader returns only well-formed devices of its own node and driver,
counts the rest as skipped, and never raises."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.agent.devicetaints import rule_name
from gpudaemon.agent.resourceslices import DRIVER, MAX_DEVICES, parse_slices

NODE = "gpu-0"
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=80))
FIELDS = ["spec", "driver", "nodeName", "pool", "name", "generation", "devices",
          "attributes", "uuid", "type", "parentUUID", "string", "version"]  # fmt: skip
values = st.recursive(
    scalars | st.sampled_from([DRIVER, NODE, "gpu", "mig", "gpu-1", "GPU-1"]),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=6),
    ),
    max_leaves=40,
)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def real_slice(devices: Any) -> dict[str, Any]:
    return {"metadata": {"name": f"{NODE}-{DRIVER}"},
            "spec": {"driver": DRIVER, "nodeName": NODE, "devices": devices,
                     "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}}}  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(values, max_size=4), st.lists(values, max_size=6))
def test_any_slice_gives_only_well_formed_devices_and_never_raises(
    slices: list[Any], devices: list[Any]
) -> None:
    items = [s for s in slices if isinstance(s, dict)] + [real_slice(devices)]
    got, skipped = parse_slices(items, NODE)
    assert skipped >= 0 and len(got) <= MAX_DEVICES
    for d in got:
        assert 0 < len(d.pool) <= 253 and DNS_LABEL.match(d.name) and d.uuid and len(d.uuid) <= 128
        assert len(rule_name(NODE, d.name)) <= 253
