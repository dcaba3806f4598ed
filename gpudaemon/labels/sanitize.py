"""The one place label values are cleaned. Sinks accept only `Labels`, which are
built through here, so an unclean value cannot reach a Node."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Mapping

MAX_VALUE_LEN = 63
DEFAULT_PREFIX = "gpudaemon.io/"  # the brief's; configurable as labels.prefix
_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME_RE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_PREFIX_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/")
_INVALID_RUN = re.compile(r"[^A-Za-z0-9_.-]+")


def sanitize_value(raw: object) -> str:
    """A valid label value for anything.

    Spaces become '-' (the GPU Feature Discovery convention, so
    "NVIDIA H100 80GB HBM3" -> "NVIDIA-H100-80GB-HBM3", the value nodeSelectors in the
    wild use). Any other change (other characters, bad ends, over 63 characters) is
    lossy, so the value gets a short hash of the original, and two names that differ in
    anything but space-versus-hyphen never clean to the same value. Space and hyphen
    are one character by design: "A B" and "A-B" both give "A-B".
    """
    if isinstance(raw, bool):
        return "true" if raw else "false"
    s = str(raw)
    simple = s.replace(" ", "-")
    if len(simple) <= MAX_VALUE_LEN and _VALUE_RE.fullmatch(simple):
        return simple
    digest = hashlib.sha256(s.encode()).hexdigest()[:8]
    cleaned = _INVALID_RUN.sub("-", s)
    cleaned = re.sub(r"-{2,}", "-", cleaned).strip("-_.")
    cleaned = cleaned[: MAX_VALUE_LEN - len(digest) - 1].rstrip("-_.")
    return f"{cleaned}-{digest}" if cleaned else digest


def is_valid_value(v: str) -> bool:
    return len(v) <= MAX_VALUE_LEN and _VALUE_RE.fullmatch(v) is not None


def validate_prefix(prefix: str) -> str:
    """A label-key prefix such as 'gpudaemon.io/' (a DNS subdomain and a slash)."""
    if len(prefix) > 254 or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"{prefix!r} is not a DNS subdomain followed by '/'")
    return prefix


class Labels(Mapping[str, str]):
    """Label keys and values that have passed through `sanitize_value`."""

    __slots__ = ("_items",)

    def __init__(self, prefix: str, raw: Mapping[str, object]) -> None:
        validate_prefix(prefix)
        items: dict[str, str] = {}
        for name, value in raw.items():
            if not _NAME_RE.fullmatch(name) or len(name) > MAX_VALUE_LEN:
                raise ValueError(f"invalid label name {name!r}")
            items[prefix + name] = sanitize_value(value)
        self._items = items

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return f"Labels({self._items!r})"
