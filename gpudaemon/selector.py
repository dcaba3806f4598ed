"""Equality label selectors (`a=b,c!=d,e,!f`), as the API server takes them: the form
check for config and the chart's schema, and the matcher the rebalancer uses for its
opt-in `rebalance.selector`. One module, so what config accepts is what matches."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

_TERM = r"\s*!?[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?(\s*(==?|!=)\s*[-A-Za-z0-9_.]*)?\s*"
_TERM_RE = re.compile(f"^{_TERM}$")
# The same for the chart's values schema: helm refuses a bad selector before install.
SELECTOR_PATTERN = f"^({_TERM}(,{_TERM})*)?$"

Matcher = Callable[[Mapping[str, str]], bool]


def check_selector(v: str) -> str:
    """`v` when it is a selector of equality terms, else ValueError (one line)."""
    if v and not all(_TERM_RE.match(t) for t in v.split(",")):
        raise ValueError(
            f"invalid label selector {v!r}: expected terms like key=value, key!=value, key or "
            "!key, separated by commas"
        )
    return v


def selector_matcher(expr: str) -> Matcher:
    """Labels -> whether they match every term; an empty selector matches nothing
    (opting in must be explicit)."""
    terms = [_term(t.strip()) for t in check_selector(expr).split(",")] if expr.strip() else []

    def matches(labels: Mapping[str, str]) -> bool:
        return bool(terms) and all(term(labels) for term in terms)

    return matches


def _term(t: str) -> Matcher:
    if "!=" in t:
        k, v = (x.strip() for x in t.split("!=", 1))
        return lambda labels: labels.get(k) != v
    if "=" in t:
        k, v = (x.strip() for x in t.replace("==", "=").split("=", 1))
        return lambda labels: labels.get(k) == v
    if t.startswith("!"):
        key = t[1:].strip()
        return lambda labels: key not in labels
    return lambda labels: t in labels
