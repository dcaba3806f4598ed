"""The bounded decoders of values a node writes (issue 28): the `gpus` annotation and
the count labels. Hostile values are one `BadValueError`, never another exception; the
agent's own largest value fits the cap with room to spare."""

from __future__ import annotations

import json

import pytest

from gpudaemon.errors import BadValueError
from gpudaemon.labels.annotations import (
    GPUS_MAX_BYTES,
    MAX_DEPTH,
    GpuStateAnnotator,
    bounded_json,
    count_label,
    decode_gpus,
    json_depth,
)
from gpudaemon.model import (
    MIB,
    GpmReading,
    GpuInfo,
    GpuSample,
    MigDevice,
    NodeInventory,
    PodRef,
    Snapshot,
)

GOOD = {"index": 0, "uuid": "GPU-0", "memory_total_mib": 81559}


def largest_agent_value() -> str:
    """What the agent writes for the largest node it supports: 8 GPUs x 7 MIG devices,
    each held by a pod with the longest legal namespace and name, every GPU unhealthy
    with a long reason and every reading present."""
    gpus, pods = [], {}
    holder = PodRef(pod="p" * 253, namespace="n" * 63, container="c")
    for i in range(8):
        migs = tuple(
            MigDevice(
                uuid=f"MIG-{i}{j}aaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
                profile="1g.10gb",
                gpu_instance_id=j + 7,
                compute_instance_id=0,
                memory_total_bytes=9984 * MIB,
            )
            for j in range(7)
        )
        gpus.append(
            GpuInfo(
                index=i,
                uuid=f"GPU-{i:08d}-bbbb-cccc-dddd-eeeeeeeeeeee",
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=81559 * MIB,
                compute_capability=(9, 0),
                mig_capable=True,
                mig_enabled=True,
                mig_devices=migs,
            )
        )
        pods.update({m.uuid: holder for m in migs})
        pods[gpus[-1].uuid] = holder
    samples = tuple(
        GpuSample(
            index=g.index,
            uuid=g.uuid,
            healthy=False,
            health_reason="xid 79 (GPU has fallen off the bus), sticky until reboot " * 2,
            gpu_utilization_ratio=1.0,
            gpm=GpmReading(sm_active_ratio=1.0),
            memory_used_bytes=81559 * MIB,
            temperature_celsius=99.0,
            process_count=99,
        )
        for g in gpus
    )
    snap = Snapshot(
        inventory=NodeInventory(driver_version="550.54.15", cuda_driver_version=(12, 4),
                                gpus=tuple(gpus)),
        samples=samples,
    )  # fmt: skip
    return GpuStateAnnotator("gpudaemon.io/").annotations(snap, pods)["gpudaemon.io/gpus"]


def test_the_agents_largest_value_decodes_well_under_the_cap() -> None:
    text = largest_agent_value()
    gpus = decode_gpus(text)
    assert len(gpus) == 8 and all(not g.healthy and len(g.pods) == 1 for g in gpus)
    assert all(g.sm_active_pct == 100 for g in gpus)
    # 29.1 KiB (29,809 bytes, with sm_active_pct): the figure docs/security.md and the cap's comment quote.
    assert len(text.encode()) < GPUS_MAX_BYTES / 2, len(text.encode())


def _gpus(*entries: object) -> str:
    return json.dumps(list(entries))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "too deep or too big"),
        ("[" * 1000 + "]" * 1000, "nested deeper"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "nested deeper"),
        (json.dumps([{**GOOD, "x": [[[[[[1]]]]]]}]), "nested deeper"),
        ('"' + "a" * (GPUS_MAX_BYTES) + '"', "over"),
        ("[" + "é" * (GPUS_MAX_BYTES // 2 + 1) + "]", "over"),  # bytes, not characters
        ("{}", "not a JSON list"),
        ("", "not JSON"),
        ("[NaN]", "not JSON"),
        ("[Infinity]", "not JSON"),
        ("[1e400]", "not JSON"),
        ('["\\ud800"]', "not JSON"),
        ("\ud800", "not valid UTF-8"),
        (_gpus(*[{**GOOD, "index": i, "uuid": f"G{i}"} for i in range(65)]), "more than 64"),
        (_gpus(1), "not an object"),
        (_gpus({**GOOD, "index": "0"}), "'index' is not an integer"),
        (_gpus({**GOOD, "index": True}), "'index' is not an integer"),
        (_gpus({**GOOD, "index": 1.0}), "'index' is not an integer"),
        (_gpus({**GOOD, "index": 2**63 - 1}), "'index' is outside"),
        (_gpus({**GOOD, "index": 2**64}), "'index' is not an integer"),  # orjson: a float
        (_gpus({**GOOD, "index": -1}), "'index' is outside"),
        (_gpus({**GOOD, "uuid": 7}), "'uuid' is not a string"),
        (_gpus({**GOOD, "uuid": ""}), "'uuid' is empty"),
        (_gpus({"index": 0, "memory_total_mib": 1}), "'uuid' is missing"),
        (_gpus({**GOOD, "healthy": "false"}), "healthy is not true or false"),
        (_gpus({**GOOD, "healthy": 0}), "healthy is not true or false"),
        (_gpus({**GOOD, "reason": {"a": 1}}), "'reason' is not a string"),
        (_gpus({**GOOD, "reason": "x" * 5000}), "'reason' is empty or over"),
        (_gpus({**GOOD, "utilization_pct": 101}), "'utilization_pct' is outside"),
        (_gpus({**GOOD, "utilization_pct": 1e308}), "'utilization_pct' is not an integer"),
        (_gpus({**GOOD, "sm_active_pct": 101}), "'sm_active_pct' is outside"),
        (_gpus({**GOOD, "sm_active_pct": -1}), "'sm_active_pct' is outside"),
        (_gpus({**GOOD, "sm_active_pct": "50"}), "'sm_active_pct' is not an integer"),
        (_gpus({**GOOD, "pods": "ns/p"}), "'pods' is not a list"),
        (_gpus({**GOOD, "pods": [1]}), "'pods' holds something other"),
        (_gpus({**GOOD, "pods": ["a/b"] * 17}), "'pods' has more than"),
        (_gpus({**GOOD, "mig": [{"pod": 1}]}), "'pod' is not a string"),
        (_gpus({**GOOD, "mig": [1]}), "a MIG entry is not an object"),
        (_gpus({**GOOD, "mig": [{}] * 17}), "'mig' has more than"),
        (_gpus(GOOD, GOOD), "listed twice"),
        ('[{"index":0,"uuid":"GPU-0","memory_total_mib":1,"index":"x"}]', "not an integer"),
    ],
)
def test_a_hostile_gpus_value_is_one_bad_value_error_naming_what_is_wrong(
    text: str, why: str
) -> None:
    with pytest.raises(BadValueError) as e:
        decode_gpus(text)
    assert e.value.key == "gpus"
    assert why in str(e.value) or why == "too deep or too big", str(e.value)
    assert isinstance(e.value, ValueError)  # older callers' `except ValueError` holds


@pytest.mark.parametrize("value", [None, 7, b"[]", ["[]"], {"a": 1}])
def test_a_value_that_is_not_text_is_a_bad_value(value: object) -> None:
    with pytest.raises(BadValueError, match="not a string"):
        decode_gpus(value)


def test_fields_a_newer_agent_adds_are_ignored_not_refused() -> None:
    text = _gpus({**GOOD, "future": {"a": [1, 2]}, "mig": [{"pod": "ns/p", "new": 1}]})
    (g,) = decode_gpus(text)
    assert g.pods == ("ns/p",) and g.healthy


def test_absent_and_null_optional_fields_read_as_unknown() -> None:
    (g,) = decode_gpus(_gpus({**GOOD, "utilization_pct": None, "pods": None}))
    assert g.utilization_pct is None and g.pods == () and g.healthy


def test_depth_is_counted_outside_strings_only() -> None:
    assert json_depth('["[[[[[[[[", {"a": "]]]]"}]', 10) == 2
    assert json_depth('["\\"[[[["]', 10) == 1
    assert json_depth("[" * 50, 6) == 7  # stops counting past the cap


def test_unterminated_strings_full_of_escaped_quotes_are_refused() -> None:
    # The scan is linear on these (a quadratic one took minutes; bench/untrusted.py
    # prints the times).
    for text in ('"\\"' * 20_000, "[" + '"\\"' * 20_000, "[" * 60_000):
        with pytest.raises(BadValueError):
            bounded_json(text, "k", GPUS_MAX_BYTES)


@pytest.mark.parametrize(
    ("value", "ok"),
    [("0", 0), ("8", 8), ("4096", 4096), ("4097", None), ("99999999999999", None),
     ("-1", None), ("8.0", None), ("", None), ("٣", None), (" 8", None), (8, None),
     (None, None)],
)  # fmt: skip
def test_count_labels_are_small_whole_numbers(value: object, ok: int | None) -> None:
    if ok is None:
        with pytest.raises(BadValueError):
            count_label(value, "gpu.count")
    else:
        assert count_label(value, "gpu.count") == ok
