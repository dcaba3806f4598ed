"""Hostile values a node may write (issue 28), fed to every reader's parser: the `gpus`
annotation decoder, the count-label parser and the extender's cluster state. Deep
nesting, huge strings, wrong types, NaN and Infinity, huge integers, unicode (lone
surrogates included), duplicate keys, and mutations of the agent's own valid value.
Each parser returns data or raises `BadValueError`, never anything else; the cluster
state never raises and marks the node "no data" exactly when the decoder refuses.
(Their speed on the worst inputs is printed by bench/untrusted.py, not asserted.)"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.errors import BadValueError
from gpudaemon.labels.annotations import GpuState, count_label, decode_gpus
from tests.unit.test_untrusted import largest_agent_value

P = "gpudaemon.io/"
VALID = largest_agent_value()

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
)
FIELDS = ["index", "uuid", "memory_total_mib", "healthy", "reason", "utilization_pct",
          "pods", "mig", "pod", "x"]  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=6),
    ),
    max_leaves=30,
)


def _dump(v: Any) -> str:
    # Python's json writes NaN/Infinity and huge ints, as a hostile writer would.
    return json.dumps(v, allow_nan=True)


@st.composite
def hostile_texts(draw: st.DrawFn) -> str:
    kind = draw(st.integers(0, 7))
    if kind == 0:  # deep nesting, balanced or not, in lists or objects
        depth = draw(st.integers(1, 20_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('[{"mig":', "}]")]))
        return (
            opener * depth
            + draw(st.sampled_from(["1", '""', ""]))
            + closer * draw(st.integers(0, depth))
        )
    if kind == 1:  # a huge string, inside a field or bare
        n = draw(st.integers(60_000, 300_000))
        return draw(st.sampled_from([f'[{{"index":0,"uuid":"{"x" * n}"}}]', "x" * n]))
    if kind == 2:  # a structure of random types at the schema's field names
        return _dump(draw(st.lists(json_values, max_size=5)))
    if kind == 3:  # the agent's own value with one field's value replaced
        doc = json.loads(VALID)
        gpu = doc[draw(st.integers(0, len(doc) - 1))]
        field = draw(st.sampled_from([*sorted(gpu), "pods", "mig"]))
        gpu[field] = draw(json_values)
        return _dump(doc)
    if kind == 4:  # the agent's value cut or spliced at a random place
        i = draw(st.integers(0, len(VALID)))
        return VALID[:i] + draw(st.text(max_size=20)) + VALID[i + draw(st.integers(0, 50)) :]
    if kind == 5:  # duplicate keys: the last one wins, and must still be checked
        v = draw(json_values)
        return f'[{{"index":0,"uuid":"G","memory_total_mib":1,"index":{_dump(v)}}}]'
    if kind == 6:  # any unicode, lone surrogates included
        return draw(st.text(max_size=200))
    return draw(st.sampled_from(["[NaN]", "[Infinity]", "[-Infinity]", "[1e999]",
                                 "[" + "9" * 5000 + "]", '["\\ud800"]', "\ud800", ""]))  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(hostile_texts())
def test_the_gpus_decoder_returns_data_or_its_one_error(text: str) -> None:
    try:
        gpus = decode_gpus(text)
    except BadValueError:
        return
    assert all(isinstance(g, GpuState) for g in gpus) and len(gpus) <= 64
    for g in gpus:  # what it returns is of the schema, whatever came in
        assert type(g.index) is int and type(g.uuid) is str and type(g.healthy) is bool
        assert all(type(p) is str for p in g.pods)
        assert g.utilization_pct is None or 0 <= g.utilization_pct <= 100


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=30), scalars, json_values))
def test_a_count_label_is_a_small_whole_number_or_the_one_error(value: Any) -> None:
    try:
        n = count_label(value, "gpu.count")
    except BadValueError:
        return
    assert type(n) is int and 0 <= n <= 4096


@settings(max_examples=300, deadline=None)
@given(hostile_texts(), st.one_of(st.none(), st.text(max_size=12), scalars))
def test_the_cluster_state_never_raises_and_marks_exactly_the_unreadable(
    text: str, count: Any
) -> None:
    labels: dict[str, Any] = {P + "gpu.product": "H100"}
    if count is not None:
        labels[P + "gpu.count"] = count
    node = {"metadata": {"name": "n", "uid": "u", "labels": labels,
                         "annotations": {P + "gpus": text}},
            "status": {"allocatable": {"nvidia.com/gpu": "8"}}}  # fmt: skip
    c = ClusterState(P)
    c.replace_nodes([node])
    c.node_event("MODIFIED", node)
    try:
        decode_gpus(text)
        if count is not None:
            count_label(count, "gpu.count")
        readable = True
    except BadValueError:
        readable = False
    assert (c.bad_reason("n") == "") == readable
    st_ = c.states(["n"])["n"]
    assert st_ is not None and (st_.bad_data == "") == readable
