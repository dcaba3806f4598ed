"""Label selectors, checked as the API server checks them: the form check for config,
`gpudaemon status -l` and the chart's schema, and the matcher the rebalancer uses for its
opt-in `rebalance.selector`. One module, so what config accepts is what matches.

A selector is terms separated by commas: `key`, `!key`, `key=value` (or `==`),
`key!=value`, and, where the API server evaluates it (`status -l`), `key in (a,b)` and
`key notin (a,b)`. Keys are qualified names (an optional DNS-subdomain prefix and `/`,
then at most 63 characters) and values label values (at most 63 characters), as in
apimachinery's `labels.Parse`; a bad one is refused here with one line, not sent."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

_TERM = r"\s*!?[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?(\s*(==?|!=)\s*[-A-Za-z0-9_.]*)?\s*"
# A coarse form for the chart's values schema (helm refuses the worst before install);
# check_selector below is the exact rule.
SELECTOR_PATTERN = f"^({_TERM}(,{_TERM})*)?$"

_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SET = re.compile(r"^(?P<key>[^\s!=(),]+)\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_EQ = re.compile(r"^(?P<key>[^\s!=(),]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^\s!=(),]*)$")
_EXISTS = re.compile(r"^(?P<neg>!?)\s*(?P<key>[^\s!=(),]+)$")

Matcher = Callable[[Mapping[str, str]], bool]


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!":
            return self.key not in labels
        if self.op in ("=", "in"):
            return self.key in labels and labels[self.key] in self.values
        return labels.get(self.key) not in self.values  # "!=", "notin": absent matches


def parse_selector(v: str, set_based: bool = True) -> list[Requirement]:
    """The terms of `v`, or ValueError with one line naming the bad term and why.
    `set_based=False` refuses `in` and `notin` (the rebalancer's schema form)."""
    out: list[Requirement] = []
    if not v.strip():
        return out
    for term in _split(v):
        t = term.strip()
        if not t:
            raise _bad(v, t, "an empty term (two commas in a row, or one at an end)")
        if m := _SET.match(t):
            if not set_based:
                raise _bad(v, t, "only key, !key, key=value and key!=value are allowed here")
            values = tuple(x.strip() for x in m["values"].split(","))
            if values == ("",):
                raise _bad(v, t, "a set needs at least one value")
            req = Requirement(_key(v, m["key"]), m["op"], tuple(_value(v, x) for x in values))
        elif m := _EQ.match(t):
            op = "=" if m["op"] in ("=", "==") else "!="
            req = Requirement(_key(v, m["key"]), op, (_value(v, m["value"]),))
        elif m := _EXISTS.match(t):
            req = Requirement(_key(v, m["key"]), "!" if m["neg"] else "exists")
        else:
            forms = "key, !key, key=value, key!=value" + (
                ", key in (a,b), key notin (a,b)" if set_based else ""
            )
            raise _bad(v, t, f"expected one of {forms}")
        out.append(req)
    return out


def check_selector(v: str) -> str:
    """`v` when it is a selector of equality terms with valid keys and values (what the
    rebalancer's matcher evaluates), else ValueError (one line)."""
    parse_selector(v, set_based=False)
    return v


def selector_matcher(expr: str) -> Matcher:
    """Labels -> whether they match every term; an empty selector matches nothing
    (opting in must be explicit)."""
    terms = parse_selector(expr, set_based=False)

    def matches(labels: Mapping[str, str]) -> bool:
        return bool(terms) and all(term.matches(labels) for term in terms)

    return matches


def _split(v: str) -> list[str]:
    """Terms split at the commas outside parentheses (`a in (x,y),b`)."""
    terms, depth, start = [], 0, 0
    for i, c in enumerate(v):
        depth += (c == "(") - (c == ")")
        if c == "," and depth == 0:
            terms.append(v[start:i])
            start = i + 1
    terms.append(v[start:])
    return terms


def _bad(v: str, term: str, why: str) -> ValueError:
    return ValueError(f"invalid label selector {v[:200]!r}: {term[:100]!r}: {why}")


def _key(v: str, key: str) -> str:
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        raise _bad(v, key, "the key's prefix is empty")
    if prefix and (len(prefix) > 253 or not all(_DNS_LABEL.match(p) for p in prefix.split("."))):
        raise _bad(v, key, "the key's prefix must be a lower-case DNS subdomain")
    if not name or len(name) > 63 or not _NAME.match(name):
        raise _bad(
            v,
            key,
            "a key's name is 1-63 letters, digits, '-', '_' or '.', starting and ending "
            "with a letter or digit",
        )
    return key


def _value(v: str, value: str) -> str:
    if value and (len(value) > 63 or not _NAME.match(value)):
        raise _bad(
            v,
            value,
            "a value is at most 63 letters, digits, '-', '_' or '.', starting and ending "
            "with a letter or digit",
        )
    return value
