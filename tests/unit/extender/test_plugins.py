"""Filter, score and reserve plug-ins (issue 29): a score plug-in from its own file is
enabled by configuration alone, with a weight, and changes the ranking by kube-scheduler's
rule (each plug-in's scores normalised, then a weighted sum); a gang's tiers still come
first; the filter plug-ins in their default order judge every node as `check_node`
does; an unknown name is one line at start (exit 2)."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import pkgutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpudaemon.cluster.checks import check_node
from gpudaemon.cluster.clusterstate import ClusterState
from gpudaemon.cluster.plugins import (
    BUILT_IN,
    POD,
    Cycle,
    CycleState,
    MissingStateError,
    PluginSpec,
    StateKey,
    UnknownPluginError,
    build_profile,
    known_plugins,
    register,
    registered,
    unregister,
)
from gpudaemon.cluster.state import NodeState, PodShape
from gpudaemon.config import Config, PluginsConfig, load_config
from gpudaemon.errors import ConfigError
from gpudaemon.extender.api import ExtenderApi
from gpudaemon.extender.app import Extender, make_policies
from tests.clock import FakeClock
from tests.support import run_cli
from tests.unit.extender import plugins_example
from tests.unit.extender.test_api import call, pod
from tests.unit.extender.test_cluster import lease_obj, node_obj, pod_obj
from tests.unit.extender.test_gang import gang_pod
from tests.unit.extender.test_registry import NoApi


@pytest.fixture
def least_busy() -> Iterator[PluginSpec]:
    spec = register(plugins_example.SPEC)  # an explicit call: importing registers nothing
    yield spec
    unregister("score", "least_busy")


def config(*score: dict[str, Any], **plugins: Any) -> Config:
    plugins.setdefault("score", list(score) or [{"name": "policy"}])
    return load_config(None, environ={}, overrides={"extender": {"plugins": plugins}})


# a: 2 GPUs free, 90 % busy; b: 6 free, 10 %; c: 8 free, 50 %. Binpack picks `a`,
# least_busy picks `b`. Normalised (0..100) for a 1-GPU pod: binpack a 100, b 29, c 0;
# least_busy a 0, b 100, c 50.
BUSY = {"a": 90, "b": 10, "c": 50}
USED = {"a": 6, "b": 2}


def cluster(gang_on: str = "") -> ClusterState:
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    c.replace_nodes([node_obj(n, uid=n, util=[u] * 8) for n, u in BUSY.items()])
    pods = [pod_obj(f"x-{n}", n, used) for n, used in USED.items()]
    if gang_on:
        pods.append(gang_pod("g1", 1, node=gang_on))
    c.replace_pods(pods)
    c.replace_leases([lease_obj(n, wall(), 300, owner_uid=n) for n in BUSY])
    return c


def api_for(cfg: Config, c: ClusterState | None = None) -> ExtenderApi:
    return ExtenderApi(
        c or cluster(),
        make_policies(cfg),
        "binpack",
        CollectorRegistry(),
        lambda: (True, "ok"),
        plugins=cfg.extender.plugins,
    )


def scores(api: ExtenderApi, p: dict[str, Any]) -> dict[str, int]:
    body = json.dumps({"Pod": p, "NodeNames": list(BUSY)}).encode()
    code, res = call(api, "/prioritize", body)
    assert code.startswith("200"), res
    return {r["Host"]: r["Score"] for r in res}


def test_a_score_plugin_from_its_own_file_is_enabled_by_config_alone(
    least_busy: PluginSpec,
) -> None:
    assert "least_busy" in known_plugins("score")
    before = scores(api_for(config()), pod("p1", 1))
    assert before == {"a": 10, "b": 9, "c": 8}  # binpack alone
    cfg = config({"name": "policy", "weight": 1}, {"name": "least_busy", "weight": 1})
    # The program's wiring builds it from the config, with no other edit.
    ext = Extender(cfg, client=NoApi(), registry=CollectorRegistry())  # type: ignore[arg-type]
    assert [(p.name, w) for p, w in ext.api.framework.profile.scores] == [
        ("policy", 1),
        ("least_busy", 1),
    ]
    # a 100 + 0, b 29 + 100, c 0 + 50: b first
    assert scores(api_for(cfg), pod("p1", 1)) == {"b": 10, "a": 9, "c": 8}


def test_weights_decide_between_score_plugins(least_busy: PluginSpec) -> None:
    # binpack x3: a 300, b 87 + 100, c 50: a first again
    cfg = config({"name": "policy", "weight": 3}, {"name": "least_busy", "weight": 1})
    assert scores(api_for(cfg), pod("p1", 1)) == {"a": 10, "b": 9, "c": 8}
    # least_busy alone orders by utilization only
    assert scores(api_for(config({"name": "least_busy"})), pod("p1", 1)) == {
        "b": 10,
        "c": 9,
        "a": 8,
    }


def test_the_pods_annotation_still_picks_the_policy_plugin(least_busy: PluginSpec) -> None:
    cfg = config({"name": "policy", "weight": 1})
    # spread: c (8 free) first, whatever the default policy
    assert scores(api_for(cfg), pod("p1", 1, "spread")) == {"c": 10, "b": 9, "a": 8}


def test_a_gang_tier_comes_before_any_weighted_sum(least_busy: PluginSpec) -> None:
    """The gang holds `c`: its next pod goes there, however heavily another plug-in
    prefers `b` (an ordered comparison, not a number added to the sum)."""
    cfg = config({"name": "policy", "weight": 1}, {"name": "least_busy", "weight": 100})
    api = api_for(cfg, cluster(gang_on="c"))
    assert max(scores(api, pod_obj("solo", "", 1)).items(), key=lambda kv: kv[1])[0] == "b"
    got = scores(api, gang_pod("g2", 1))
    assert max(got.items(), key=lambda kv: kv[1])[0] == "c"


def test_narrowing_in_filter_uses_the_same_weighted_sum(least_busy: PluginSpec) -> None:
    cfg = load_config(
        None,
        environ={},
        overrides={
            "extender": {
                "candidates": 1,
                "plugins": {"score": [{"name": "policy"}, {"name": "least_busy"}]},
            }
        },
    )
    api = ExtenderApi(
        cluster(),
        make_policies(cfg),
        "binpack",
        CollectorRegistry(),
        lambda: (True, "ok"),
        candidates=1,
        plugins=cfg.extender.plugins,
    )
    body = json.dumps({"Pod": pod("", 1), "NodeNames": list(BUSY)}).encode()
    _, res = call(api, "/filter", body)
    assert res["NodeNames"] == ["b"]


def test_no_reserve_plugin_assumes_nothing() -> None:
    c = cluster()
    api = api_for(config(reserve=[]), c)
    scores(api, pod("p1", 1))
    assert c.states(["a"])["a"].gpus_free == 2  # type: ignore[union-attr]
    scores(api_for(config(), c), pod("p2", 1))  # default: assume
    assert c.states(["a"])["a"].gpus_free == 1  # type: ignore[union-attr]


def test_filter_order_is_the_configured_order() -> None:
    """A stale node without room: `fresh` first names staleness; `gpu_fit` first, the
    missing GPUs. Without `healthy`, a node with a failed GPU is admitted."""
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    c.replace_nodes([node_obj("full", uid="full"), node_obj("sick", healthy=7, uid="sick")])
    c.replace_pods([pod_obj("x", "full", 8)])
    c.replace_leases([lease_obj("sick", wall(), 300, owner_uid="sick")])
    body = json.dumps({"Pod": pod("", 1), "NodeNames": ["full", "sick"]}).encode()

    def filtered(**plugins: Any) -> dict[str, Any]:
        return call(api_for(config(**plugins), c), "/filter", body)[1]  # type: ignore[no-any-return]

    default = filtered()
    assert "stale" in default["FailedNodes"]["full"]
    assert "unhealthy" in default["FailedNodes"]["sick"]
    swapped = filtered(filter=["gpu_fit", "fresh", "healthy"])
    assert "pod needs 1 GPU(s), 0 healthy free" in swapped["FailedNodes"]["full"]
    assert filtered(filter=["fresh", "gpu_fit"])["NodeNames"] == ["sick"]


# -- the default filter chain is check_node, node by node ------------------------------


def _states() -> Iterator[NodeState | None]:
    yield None
    for labels, bad, unhealthy, used, assumed, mig in itertools.product(
        (True, False), ("", "bad label"), (0, 1), (0, 5, 8), (0, 2), (0, 3)
    ):
        yield NodeState(
            "n",
            gpus_allocatable=8,
            gpus_requested=used,
            gpus_assumed=min(assumed, used),
            gpus_unhealthy=unhealthy,
            has_agent_labels=labels,
            bad_data=bad,
            mig_allocatable=(("1g.10gb", mig),) if mig else (),
        )


PODS = [PodShape(1), PodShape(4), PodShape(0, mig=(("1g.10gb", 2),)), PodShape(1, mig=(("3g", 1),))]


@pytest.mark.parametrize("avoid_unhealthy", [True, False])
def test_the_default_filters_judge_every_node_as_check_node_does(avoid_unhealthy: bool) -> None:
    handle = SimpleNamespace(
        cluster=None,
        policies={},
        avoid_unhealthy=avoid_unhealthy,
        prefer_healthy_gpus=True,
        pending=None,
        reservations=None,
    )
    profile = build_profile(PluginsConfig(), handle)  # type: ignore[arg-type]
    cases = [(st, fr) for st in _states() for fr in (True, False)]
    names = [f"n{i}" for i in range(len(cases))]
    states = {n: st for n, (st, _) in zip(names, cases, strict=True)}
    fresh = {n: fr for n, (_, fr) in zip(names, cases, strict=True)}
    for shape in PODS:
        state = CycleState()
        state.write(POD, Cycle({}, shape, None, "", 0.0))  # type: ignore[arg-type]
        rejected: dict[str, Any] = {}
        passed = names
        for f in profile.filters:
            run = f.filter(state)
            if run is not None:
                passed = run(passed, states, fresh, rejected)
        for n in names:
            want = check_node(states[n], shape, fresh=fresh[n], avoid_unhealthy=avoid_unhealthy)
            assert rejected.get(n) == want, (n, states[n], fresh[n], shape)
            assert (n in passed) == (want is None)


# -- configuration ----------------------------------------------------------------------


def test_an_unknown_plugin_is_one_line_at_start(tmp_path: Path) -> None:
    cfg = config({"name": "coolest"})
    with pytest.raises(UnknownPluginError, match=r"extender.plugins.score: unknown score plug-in"):
        make_policies(cfg)
    f = tmp_path / "c.yaml"
    f.write_text("extender: {plugins: {filter: [fresh, gpu_fits]}}\n")
    p = run_cli("extender", "--config", str(f))
    assert p.returncode == 2, p
    (line,) = p.stderr.strip().splitlines()
    assert "extender.plugins.filter: unknown filter plug-in 'gpu_fits'" in line
    assert all(name in line for name in ("fresh", "gpu_fit", "healthy", "reserved"))


@pytest.mark.parametrize(
    ("plugins", "error"),
    [
        ({"filter": ["fresh", "fresh"]}, "filter: fresh named more than once"),
        ({"score": [{"name": "policy"}, "policy"]}, "score: policy named more than once"),
        ({"score": [{"name": "policy", "weight": 0}]}, "greater than or equal to 1"),
        ({"score": [{"name": "policy", "weight": 101}]}, "less than or equal to 100"),
        ({"score": []}, "at least 1"),
        ({"reserve": ["Assume!"]}, "should match pattern"),
    ],
)
def test_bad_plugin_config_is_refused(plugins: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        load_config(None, environ={}, overrides={"extender": {"plugins": plugins}})


def test_a_bare_score_name_has_weight_one() -> None:
    cfg = config(score=["policy", {"name": "binpack", "weight": 2}])
    assert [(s.name, s.weight) for s in cfg.extender.plugins.score] == [
        ("policy", 1),
        ("binpack", 2),
    ]


# -- the registry, the cycle state, each plug-in's arguments, the tiers -------------------


def test_importing_the_plugin_modules_changes_no_registry() -> None:
    """The table in registry.py is the one list: a plug-in module defines its SPEC and
    makes no call at import (no `register(...)`), and every module's SPEC is in the
    table."""
    import gpudaemon.cluster.plugins as package

    before = registered()
    specs = []
    for mod in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{mod.name}")
        tree = ast.parse(Path(module.__file__ or "").read_text())
        calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        assert not calls, f"{mod.name}: a call at import"
        if hasattr(module, "SPEC"):
            specs.append(module.SPEC)
    assert registered() == before
    assert {(s.kind, s.name) for s in specs} == {(s.kind, s.name) for s in BUILT_IN}
    assert set(before) == {(s.kind, s.name) for s in BUILT_IN}


def test_the_cycle_state_is_read_by_typed_key() -> None:
    state = CycleState()
    key: StateKey[int] = StateKey("answer")
    assert state.get(key) is None
    with pytest.raises(MissingStateError, match="answer"):
        state.read(key)
    state.write(key, 42)
    assert state.read(key) == 42
    assert state.get(StateKey("answer")) is None  # keys are compared by identity


def _sick_cluster() -> ClusterState:
    wall = FakeClock()
    c = ClusterState("gpudaemon.io/", wall=wall)
    c.replace_nodes([node_obj("sick", healthy=7, uid="sick")])
    c.replace_leases([lease_obj("sick", wall(), 300, owner_uid="sick")])
    return c


def _passes_sick(cfg: Config) -> bool:
    make_policies(cfg)  # the start-up check
    ext = cfg.extender
    api = ExtenderApi(
        _sick_cluster(),
        make_policies(cfg),
        "binpack",
        CollectorRegistry(),
        lambda: (True, "ok"),
        avoid_unhealthy=ext.avoid_unhealthy_nodes,
        plugins=ext.plugins,
    )
    body = json.dumps({"Pod": pod("", 1), "NodeNames": ["sick"]}).encode()
    return call(api, "/filter", body)[1]["NodeNames"] == ["sick"]  # type: ignore[no-any-return]


def test_each_plugin_gets_its_own_arguments_over_the_older_keys() -> None:
    def cfg(**ext: Any) -> Config:
        return load_config(None, environ={}, overrides={"extender": ext})

    assert not _passes_sick(cfg())
    assert _passes_sick(cfg(avoid_unhealthy_nodes=False))  # the older key: the default
    assert _passes_sick(cfg(plugins={"args": {"healthy": {"enabled": False}}}))
    assert not _passes_sick(
        cfg(avoid_unhealthy_nodes=False, plugins={"args": {"healthy": {"enabled": True}}})
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"healthy": {"enable": False}}, r"extender.plugins.args.healthy.enable: Extra inputs"),
        ({"healthy": {"enabled": 1}}, r"extender.plugins.args.healthy.enabled"),
        ({"fresh": {"x": 1}}, r"extender.plugins.args.fresh.x: Extra inputs"),
        ({"healthiest": {}}, r"extender.plugins.args: unknown plug-in 'healthiest'"),
    ],
)
def test_bad_plugin_arguments_are_one_line_at_start(args: dict[str, Any], error: str) -> None:
    cfg = load_config(None, environ={}, overrides={"extender": {"plugins": {"args": args}}})
    with pytest.raises(ConfigError, match=error):
        make_policies(cfg)


def test_tiers_are_an_ordered_comparison_in_the_configured_order(
    least_busy: PluginSpec,
) -> None:
    """Without the `gang` tier a gang pod goes by the weighted sum alone; with it, to
    the node its gang holds (test_a_gang_tier_comes_before_any_weighted_sum)."""
    score = [{"name": "policy", "weight": 1}, {"name": "least_busy", "weight": 100}]
    api = api_for(config(*score, tiers=["healthy_gpus"]), cluster(gang_on="c"))
    got = scores(api, gang_pod("g2", 1))
    assert max(got.items(), key=lambda kv: kv[1])[0] == "b"
    with pytest.raises(UnknownPluginError, match=r"extender.plugins.tiers: unknown tier"):
        make_policies(config(tiers=["policy"]))
