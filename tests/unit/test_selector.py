"""Label selectors are checked here as the API server checks them (issue 28): a bad one
in `rebalance.selector` or `status -l` is one line and exit 2, never sent. A table of
accepted and refused selectors, and what each accepted one matches."""

from __future__ import annotations

import pytest

from gpudaemon.config import load_config
from gpudaemon.errors import ConfigError
from gpudaemon.selector import check_selector, parse_selector, selector_matcher
from tests.support import run_cli

GOOD = [
    # selector, labels that match, labels that do not
    ("team=ml", {"team": "ml"}, {"team": "ops"}),
    ("team==ml", {"team": "ml"}, {}),
    ("tier!=prod", {}, {"tier": "prod"}),
    ("batch", {"batch": ""}, {}),
    ("!pinned", {}, {"pinned": "x"}),
    ("example.com/rack=r1, team=ml", {"example.com/rack": "r1", "team": "ml"}, {"team": "ml"}),
    ("a=", {"a": ""}, {"a": "x"}),
]
BAD = [
    ("a b", "expected one of"),
    ("a=b=c", "expected one of"),
    ("!a=b", "expected one of"),
    ("-a", "a key's name"),
    ("a/b/c", "prefix must be a lower-case DNS subdomain"),
    ("Example.com/x=1", "prefix must be a lower-case DNS subdomain"),
    ("/x", "prefix is empty"),
    ("a=-x", "a value is at most 63"),
    ("a=" + "v" * 64, "a value is at most 63"),
    ("k" * 64, "a key's name"),
    ("a,,b", "an empty term"),
    ("a,", "an empty term"),
    ("(", "expected one of"),
]


@pytest.mark.parametrize(("sel", "yes", "no"), GOOD)
def test_equality_selectors_are_accepted_and_match(
    sel: str, yes: dict[str, str], no: dict[str, str]
) -> None:
    assert check_selector(sel) == sel
    m = selector_matcher(sel)
    assert m(yes) and not m(no)


@pytest.mark.parametrize(("sel", "why"), BAD)
def test_bad_selectors_are_one_line_naming_the_term(sel: str, why: str) -> None:
    for set_based in (False, True):
        with pytest.raises(ValueError, match=why) as e:
            parse_selector(sel, set_based)
        assert "\n" not in str(e.value)


def test_set_based_terms_are_for_the_api_server_only() -> None:
    sel = "zone in (a, b),tier notin (prod)"
    assert [(r.key, r.op, r.values) for r in parse_selector(sel)] == [
        ("zone", "in", ("a", "b")),
        ("tier", "notin", ("prod",)),
    ]
    with pytest.raises(ValueError, match="only key, !key, key=value and key!=value"):
        check_selector(sel)  # the rebalancer's matcher evaluates equality terms only
    with pytest.raises(ValueError, match="a set needs at least one value"):
        parse_selector("zone in ()")


def test_an_empty_selector_matches_nothing() -> None:
    assert not selector_matcher("")({"anything": "x"})


def test_a_bad_rebalance_selector_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"rebalance\.selector: invalid label selector"):
        load_config(environ={}, overrides={"rebalance": {"selector": "Team=ml/x"}})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-l", "a b"], "-l/--selector: invalid label selector"),
        (["-l", "app=-x"], "a value is at most 63"),
        (["-n", "Not_A_Namespace"], "-n/--namespace: 'Not_A_Namespace' is not a namespace"),
    ],
)
def test_status_refuses_a_bad_selector_or_namespace_locally(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")  # it must not get as far as a server
    p = run_cli("status", *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0], p.stderr
