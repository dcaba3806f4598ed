"""The value types every section shares (numbers, switches, listen addresses, cron,
DNS names, InfluxDB URLs) and the two base classes: `_Section` (unknown keys are an
error) and `_View` (a model that validates part of a larger one and only checks the
names of the rest). Pure: nothing here touches the filesystem or the environment."""

from __future__ import annotations

import ipaddress
import re
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gpudaemon.errors import UsageError
from gpudaemon.schedule import CRON_PATTERN

DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS1123_SUBDOMAIN_PATTERN = f"^{DNS1123_SUBDOMAIN.pattern}$"
DNS1123_LABEL_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
LABEL_OUTPUTS = ("apiserver", "stdout", "nfd", "none")
# Where Node Feature Discovery's local source reads feature files: this directory only
# (its featureFilesDir), top-level regular files whose names do not start with "."
# (source/local/local.go). The agent's pod mounts the host's directory at the same path.
NFD_FEATURES_DIR = "/etc/kubernetes/node-feature-discovery/features.d/"
NFD_PATH_PATTERN = "^" + re.escape(NFD_FEATURES_DIR) + "[^/.][^/]*$"


def _check_dns_subdomain(v: str) -> str:
    if not DNS1123_SUBDOMAIN.fullmatch(v) or len(v) > 253:
        raise ValueError(f"{v!r} is not a DNS-1123 subdomain (lower-case a-z, 0-9, '-', '.')")
    return v


def _check_dns_label(v: str) -> str:
    if not re.fullmatch(DNS1123_LABEL_PATTERN[1:-1], v) or len(v) > 63:
        raise ValueError(f"{v!r} is not a namespace name (a DNS-1123 label: a-z, 0-9, '-')")
    return v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


def _check_listen(v: str) -> str:
    from gpudaemon.httpserver import parse_listen  # the one parser, shared with the server

    try:
        parse_listen(v, "listen")
    except UsageError as e:
        raise ValueError(str(e).removeprefix("listen: ")) from None
    return v


def _not_bool(v: Any) -> Any:
    # YAML `true` is not a count; "50" from an environment variable is.
    if isinstance(v, bool):
        raise ValueError("expected a whole number, got a boolean")
    return v


def _not_bool_number(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, got a boolean")
    return v


def _not_number(v: Any) -> Any:
    # YAML `1` is not a switch; "true" from an environment variable is.
    if isinstance(v, int | float) and not isinstance(v, bool):
        raise ValueError("expected true or false, got a number")
    return v


def _check_labels_to(v: str) -> str:
    """A word, or a file path; a typo of a word ("apiservr") must not become a file."""
    if v in LABEL_OUTPUTS or "/" in v:
        return v
    raise ValueError(
        f"{v!r} is not one of {', '.join(LABEL_OUTPUTS)}, nor a file path "
        "(a path contains '/': ./labels.json, /var/run/labels.json)"
    )


def _check_nfd_path(v: str) -> str:
    """A file NFD reads: anywhere else, `labels.to: nfd` would write labels nobody reads."""
    if not re.fullmatch(NFD_PATH_PATTERN[1:-1], v) or len(v) > 255:
        raise ValueError(
            f"{v!r} is not a file in NFD's features directory {NFD_FEATURES_DIR}, the one "
            "place NFD reads feature files (a file directly in it, its name not starting "
            f"with '.'), e.g. {NFD_FEATURES_DIR}gpudaemon"
        )
    return v


_HOST = re.compile(
    r"(?:[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*\.?"
)


def redact_url(url: str) -> str:
    """`url` without its user and password (http://user:pw@host -> http://***@host):
    the only form of a URL that may appear in a message or a log line."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _check_influx_url(url: str) -> str:
    """Empty (history off) or http(s)://host[:port][/path]: anything else would fail on
    every write at run time while the agent looked healthy. Messages show the URL
    without credentials."""
    if not url:
        return url
    v = redact_url(url)
    try:
        u = urlsplit(url)
        port = u.port  # ValueError when not a number in 0..65535
    except ValueError as e:
        raise ValueError(f"{v!r}: {e}") from None
    if u.scheme not in ("http", "https"):
        raise ValueError(f"{v!r}: the scheme must be http:// or https://")
    host = u.hostname or ""
    if u.netloc.startswith("[") or ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{v!r}: {host!r} is not a valid IPv6 address") from None
    elif not host or len(host) > 253 or not _HOST.fullmatch(host):
        raise ValueError(f"{v!r}: {host!r} is not a valid host name or address")
    if port == 0 or (u.netloc.endswith(":") and port is None):
        raise ValueError(f"{v!r}: the port must be 1..65535")
    if u.query or u.fragment:
        raise ValueError(f"{v!r}: no query or fragment (the agent adds /api/v2/write?...)")
    return url


# "host:port", "[v6]:port" or ":port": the one listen-address type (agent and extender).
ListenAddress = Annotated[str, AfterValidator(_check_listen)]
# A whole number: 50 or "50" (environment variables are strings), not 1.5 or true.
WholeNumber = Annotated[int, BeforeValidator(_not_bool)]
# A finite number: 2.5 or "2.5", not true, .inf or .nan. Every one also has bounds
# below, so nothing accepted here can overflow where it is used (a 1e12 s timeout did).
Number = Annotated[float, BeforeValidator(_not_bool_number), Field(allow_inf_nan=False)]
# A switch: true/false (or "true" from the environment), not 1 or 0.
Switch = Annotated[bool, BeforeValidator(_not_number)]

# The cron form in the JSON schema too (the Helm chart's values schema): `helm install`
# refuses what the agent would (schedule.py: check_cron_form; the range order is the
# chart template's check).
Cron = Annotated[str, Field(json_schema_extra={"pattern": CRON_PATTERN})]
CronOrNone = Annotated[
    str, Field(json_schema_extra={"pattern": "^(?:none|" + CRON_PATTERN[1:-1] + ")$"})
]


def _model_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model inside a field's annotation (Annotated, Optional, list unwrapped), and
    whether it is a list of them."""
    tp, many = annotation, False
    while True:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Annotated:
            tp = args[0]
        elif origin in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1:
                return None, False
            tp = rest[0]
        elif origin is list:
            tp, many = args[0], True
        else:
            break
    return (tp, many) if isinstance(tp, type) and issubclass(tp, BaseModel) else (None, False)


def _field_names(model: type[BaseModel]) -> dict[str, Any]:
    """Key -> annotation, by alias and by name (logging.json is `json_` in Python)."""
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        out[name] = out[f.alias or name] = f.annotation
    return out


def check_names(model: type[BaseModel], value: Any, where: str) -> None:
    """Every key in `value` (a part of the file this program does not validate) is a key
    of `model`, sections and lists of sections followed: a typo is a typo for every
    program, while the values belong to the programs that use them."""
    if not isinstance(value, Mapping):
        return
    known = _field_names(model)
    for key, sub in value.items():
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown key")
        inner, many = _model_of(known[key])
        if inner is None:
            continue
        for i, item in enumerate(sub if many and isinstance(sub, list) else [sub]):
            check_names(inner, item, f"{where}.{key}" + (f".{i}" if many else ""))


class _View(_Section):
    """A model that validates some keys of a larger one (`whole()`): the keys it lacks
    are checked by name only and dropped, so a shared file with another program's keys
    still loads, and an unknown key is still an error, as it always was."""

    @classmethod
    def whole(cls) -> type[BaseModel]:
        raise NotImplementedError

    @model_validator(mode="before")
    @classmethod
    def _others(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        mine = _field_names(cls)
        whole = _field_names(cls.whole())
        out = {}
        for key, value in data.items():
            if key in mine or key not in whole:
                out[key] = value  # ours, or unknown (extra="forbid" names it)
                continue
            where = str(key)  # (pydantic puts a nested view's own place before it)
            inner, many = _model_of(whole[key])
            if inner is not None:
                for i, item in enumerate(value if many and isinstance(value, list) else [value]):
                    check_names(inner, item, where + (f".{i}" if many else ""))
        return out
