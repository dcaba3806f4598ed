"""The command line: run, probe, extender, rebalance, status, cleanup, check-config,
version. Bad
input is one line on stderr and exit 2. Installed as `kubectl-gpudaemon` too, so
`kubectl gpudaemon status` works."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from gpudaemon import __version__
from gpudaemon.errors import GpudaemonError, UsageError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from gpudaemon.kube.client import Credentials

EXIT_USAGE = 2
# The programs and their models (gpudaemon.config.PROGRAMS; named here so that --help
# does not import the configuration).
PROGRAMS = ("agent", "extender", "rebalancer", "status")
M = TypeVar("M", bound="BaseModel")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


class _HelpFormatter(argparse.HelpFormatter):
    """Help names things people copy (policies, profiles, keys like fragmentation-model):
    lines are never broken at a hyphen inside them."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        # Help that names what a registry holds (policies, profiles), computed only when
        # help is printed: the registries import what a plain run of the CLI need not.
        self.lazy_help: dict[argparse.Action, Callable[[], str]] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")

    def format_help(self) -> str:
        for action, text in self.lazy_help.items():
            action.help = text().replace("%", "%%")
        return super().format_help()


def _lazy(
    parser: argparse.ArgumentParser, action: argparse.Action, text: Callable[[], str]
) -> None:
    assert isinstance(parser, _Parser)
    action.help = "(computed when help is printed)"
    parser.lazy_help[action] = text


def _profiles_help() -> str:
    from gpudaemon.backends.simulated.profile import BUILTIN_PROFILES

    return (
        f"simulated GPUs: a built-in profile ({', '.join(BUILTIN_PROFILES)}) or a profile YAML file"
    )


def _policies_help() -> str:
    from gpudaemon.cluster.policies import known_policies

    return f"scoring policy: {' | '.join(known_policies())} (docs/reference/policies.md)"


def _labels_to_help() -> str:
    from gpudaemon.config import LABEL_OUTPUTS, LabelsConfig

    nfd = LabelsConfig.model_fields["nfd_path"].default
    words = {
        "apiserver": "apiserver (the default; with no Kubernetes credentials it falls back to "
        "stdout, saying why, unless asked for by name: then exit 2)",
        "nfd": f"nfd (GFD's key=value lines in labels.nfd_path, default {nfd}: a file "
        "in NFD's features directory, the one place NFD reads)",
    }
    return " | ".join([*(words.get(w, w) for w in LABEL_OUTPUTS), "a file path (JSON)"])


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpudaemon", description="GPU node agent for Kubernetes.")
    p.add_argument(
        "--version", action="version", version=f"gpudaemon {__version__}", help="same as 'version'"
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    run = sub.add_parser("run", help="run the agent (labels, metrics, history)")
    run.add_argument("--config", metavar="FILE", help="YAML configuration file")
    _lazy(run, run.add_argument("--simulate", metavar="PROFILE|FILE"), _profiles_help)
    run.add_argument("--seed", type=int, help="seed for simulated readings (reproducible runs)")
    run.add_argument(
        "--node-name", metavar="NAME", help="this Node's name (default $NODE_NAME, hostname)"
    )
    _lazy(run, run.add_argument("--labels-to", metavar="DEST"), _labels_to_help)
    run.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="for labels.to apiserver (default: in-cluster, $KUBECONFIG, ~/.kube/config); "
        "a file that does not exist is an error",
    )
    run.add_argument("--listen", metavar="HOST:PORT", help="metrics address (default 0.0.0.0:9445)")
    run.add_argument(
        "--once",
        action="store_true",
        help="one full cycle, then exit: 0 when every step succeeded, 1 when one failed "
        "(a poll, the label sink, history or the Lease), 2 on bad input",
    )
    run.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    run.add_argument("--log-level", metavar="LEVEL", help="TRACE, DEBUG, INFO, WARNING, ERROR")

    probe = sub.add_parser("probe", help="poll once and print GPUs, labels and annotations")
    probe.add_argument(
        "--config", metavar="FILE", help="YAML configuration file (simulate, labels.prefix)"
    )
    _lazy(probe, probe.add_argument("--simulate", metavar="PROFILE|FILE"), _profiles_help)
    probe.add_argument("--seed", type=int, help="seed for simulated readings")
    probe.add_argument("--format", choices=["table", "json"], default="table")
    probe.add_argument("--prefix", help="label prefix (default gpudaemon.io/)")

    ext = sub.add_parser("extender", help="run the kube-scheduler extender (scoring plugin)")
    ext.add_argument("--config", metavar="FILE", help="YAML configuration file")
    ext.add_argument("--listen", metavar="HOST:PORT", help="address (default 0.0.0.0:9446)")
    _lazy(ext, ext.add_argument("--policy", metavar="NAME"), _policies_help)
    ext.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    ext.add_argument("--log-level", metavar="LEVEL", help="TRACE, DEBUG, INFO, WARNING, ERROR")

    rb = sub.add_parser(
        "rebalance",
        help="move pods off unhealthy GPUs and make room for pending GPU pods (dry run "
        "unless --apply)",
    )
    rb.add_argument("--config", metavar="FILE", help="YAML configuration file (section rebalance)")
    mode = rb.add_mutually_exclusive_group()
    mode.add_argument(
        "--apply", action="store_true", help="evict for real (default: log and emit Events only)"
    )
    mode.add_argument(
        "--dry-run", action="store_true", help="log and emit Events only, whatever the config says"
    )
    rb.add_argument("--listen", metavar="HOST:PORT", help="metrics address (default 0.0.0.0:9447)")
    rb.add_argument(
        "--kubeconfig", metavar="FILE", help="default: in-cluster, $KUBECONFIG, ~/.kube/config"
    )
    rb.add_argument(
        "--identity",
        metavar="NAME",
        help="holder identity in the leader Lease (default: kubernetes.holder_identity if "
        "set, else $POD_NAME or the hostname plus a random suffix, unique per process)",
    )
    rb.add_argument("--log-json", action="store_true", help="log one JSON object per line")
    rb.add_argument("--log-level", metavar="LEVEL", help="TRACE, DEBUG, INFO, WARNING, ERROR")

    st = sub.add_parser(
        "status", help="free and healthy GPUs per node, from the API server (no agent needed)"
    )
    st.add_argument("--config", metavar="FILE", help="YAML configuration file (labels.prefix)")
    st.add_argument(
        "--kubeconfig", metavar="FILE", help="default: $KUBECONFIG, then ~/.kube/config"
    )
    st.add_argument("-l", "--selector", default="", help="label selector for the nodes")
    st.add_argument(
        "-n",
        "--namespace",
        metavar="NS",
        help="namespace of the agents' Leases (the chart's release namespace; default: "
        "found by the Leases' label, else kubernetes.lease_namespace)",
    )
    st.add_argument("-o", "--output", choices=["table", "json"], default="table")
    st.add_argument("--prefix", help="label prefix (default gpudaemon.io/)")
    st.add_argument(
        "--pool-label", default="", help="node-pool label (default: GKE, EKS, AKS, Karpenter)"
    )

    cl = sub.add_parser(
        "cleanup",
        help="remove what gpudaemon wrote to the cluster (node labels, annotations, "
        "condition and taint, DeviceTaintRules, Leases): the uninstall step",
    )
    cl.add_argument("--config", metavar="FILE", help="YAML configuration file (labels.prefix)")
    cl.add_argument(
        "--kubeconfig", metavar="FILE", help="default: in-cluster, $KUBECONFIG, ~/.kube/config"
    )
    cl.add_argument(
        "-n",
        "--namespace",
        metavar="NS",
        help="namespace of the Leases (the release namespace; default "
        "kubernetes.lease_namespace, gpudaemon)",
    )
    cl.add_argument("--prefix", help="label prefix (default gpudaemon.io/)")
    cl.add_argument("--dry-run", action="store_true", help="say what would go, change nothing")

    cc = sub.add_parser(
        "check-config",
        help="validate a configuration file as the programs do: 0 when valid, 2 naming the key",
    )
    cc.add_argument("--config", metavar="FILE", help="YAML configuration file (and GPUDAEMON_*)")
    cc.add_argument(
        "--program",
        choices=[*PROGRAMS, "all"],
        default="all",
        help="validate as this program does (default: all, each in turn, as a shared file "
        "is read by each)",
    )
    cc.add_argument(
        "--files",
        action="store_true",
        help="also check the files it names (InfluxDB token, kubeconfig), as each program's "
        "start does; off by default: they exist where the program runs",
    )

    sub.add_parser("version", help="print the version")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "probe":
            return _probe(args)
        if args.command == "extender":
            return _extender(args)
        if args.command == "rebalance":
            return _rebalance(args)
        if args.command == "status":
            return _status(args)
        if args.command == "cleanup":
            return _cleanup(args)
        if args.command == "check-config":
            return _check_config(args)
        if args.command == "version":
            print(f"gpudaemon {__version__}")
            return 0
        build_parser().print_help()
        return EXIT_USAGE
    except UsageError as e:
        print(f"gpudaemon: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except GpudaemonError as e:
        print(f"gpudaemon: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `gpudaemon probe | head`
        sys.stderr.close()
        return 0


# Flag -> config key, per command: a flag overrides the file and the environment.
Flags = dict[str, tuple[str, ...]]
_LOG_FLAGS: Flags = {"log_json": ("logging", "json"), "log_level": ("logging", "level")}
_RUN_FLAGS: Flags = {
    "simulate": ("simulate",),
    "seed": ("simulate_seed",),
    "node_name": ("node_name",),
    "labels_to": ("labels", "to"),
    "kubeconfig": ("kubernetes", "kubeconfig"),
    "listen": ("metrics", "listen"),
    **_LOG_FLAGS,
}
_EXTENDER_FLAGS: Flags = {
    "listen": ("extender", "listen"),
    "policy": ("extender", "policy"),
    **_LOG_FLAGS,
}
_REBALANCE_FLAGS: Flags = {
    "listen": ("rebalance", "listen"),
    "kubeconfig": ("kubernetes", "kubeconfig"),
    "identity": ("kubernetes", "holder_identity"),
    **_LOG_FLAGS,
}
_STATUS_FLAGS: Flags = {
    "kubeconfig": ("kubernetes", "kubeconfig"),
    "prefix": ("labels", "prefix"),
}
_PROBE_FLAGS: Flags = {
    "simulate": ("simulate",),
    "seed": ("simulate_seed",),
    "prefix": ("labels", "prefix"),
}


def _overrides(args: argparse.Namespace, flags: Flags = _RUN_FLAGS) -> dict[str, Any]:
    """The config overrides of the flags that were given."""
    o: dict[str, Any] = {}
    for attr, path in flags.items():
        v = getattr(args, attr, None)
        if v is None or v is False or v == "":
            continue
        node = o
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = v
    return o


def _load(model: type[M], args: argparse.Namespace, overrides: dict[str, Any]) -> M:
    """The program's model from --config, the environment and its flags, then the files
    it names (config/files.py): a bad one is one line and exit 2 here, at the start."""
    from gpudaemon.config import check_files, load_settings

    cfg = load_settings(model, args.config, overrides=overrides)
    check_files(cfg)
    return cfg


def _warn_environment() -> None:
    """One WARNING per GPUDAEMON_* variable that nothing reads but a near name would:
    it is ignored (it may be another tool's), so a typo of `__` would pass unseen."""
    from loguru import logger

    from gpudaemon.config.environment import near_misses, process_environ

    for name, likely in near_misses(process_environ()):
        logger.warning(
            "environment {} is not a gpudaemon setting and is ignored: did you mean {}? "
            "(nested keys are joined by '__')",
            name,
            likely,
        )


def _run(args: argparse.Namespace) -> int:
    from gpudaemon.agent.app import Agent
    from gpudaemon.config import AgentSettings
    from gpudaemon.logsetup import setup_logging
    from gpudaemon.runtime import cap_malloc_arenas

    cfg = _load(AgentSettings, args, _overrides(args))
    setup_logging(cfg.logging.level, cfg.logging.json_)
    _warn_environment()
    cap_malloc_arenas()  # before the agent's threads: its memory budget (bench/memory)
    agent = Agent(cfg)
    if not args.once:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: agent.stop_event.set())
    return agent.run(once=args.once)


def _extender(args: argparse.Namespace) -> int:
    from gpudaemon.config import ExtenderSettings
    from gpudaemon.extender.app import Extender
    from gpudaemon.logsetup import setup_logging

    cfg = _load(ExtenderSettings, args, _overrides(args, _EXTENDER_FLAGS))
    setup_logging(cfg.logging.level, cfg.logging.json_)
    _warn_environment()
    ext = Extender(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: ext.stop_event.set())
    return ext.run()


def _rebalance(args: argparse.Namespace) -> int:
    from gpudaemon.config import RebalancerSettings
    from gpudaemon.logsetup import setup_logging
    from gpudaemon.rebalancer.app import Rebalancer

    overrides = _overrides(args, _REBALANCE_FLAGS)
    if args.apply or args.dry_run:
        overrides.setdefault("rebalance", {})["dry_run"] = bool(args.dry_run)
    cfg = _load(RebalancerSettings, args, overrides)
    setup_logging(cfg.logging.level, cfg.logging.json_)
    _warn_environment()
    rb = Rebalancer(cfg, cfg.kubernetes.leader_identity)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: rb.stop_event.set())
    return rb.run()


def _probe(args: argparse.Namespace) -> int:
    from gpudaemon.agent.cache import Cache
    from gpudaemon.agent.poller import Poller
    from gpudaemon.backends import make_backend
    from gpudaemon.config import AgentSettings, load_settings
    from gpudaemon.labels import NodeLabeler
    from gpudaemon.logsetup import setup_logging

    setup_logging("WARNING")
    _warn_environment()
    _check_prefix(args.prefix)
    # The agent's model; probe reads no token and no kubeconfig, so no file checks.
    cfg = load_settings(AgentSettings, args.config, overrides=_overrides(args, _PROBE_FLAGS))
    backend = make_backend(cfg.simulate, seed=cfg.simulate_seed)
    try:
        cache = Cache()
        poller = Poller(backend, cache)
        poller.inventory()
        poller.telemetry()
        poller.energy()
        snap = cache.get()
    finally:
        backend.close()
    ls = NodeLabeler(cfg.labels.prefix, mig_strategy=cfg.labels.mig_strategy).build(snap)
    assert snap.inventory is not None
    gpus = []
    for info in snap.inventory.gpus:
        s = snap.sample_for(info.index)
        d: dict[str, Any] = asdict(info)
        d["compute_capability"] = "{}.{}".format(*info.compute_capability)
        d["memory_total_mib"] = info.memory_total_mib
        if s is not None:
            reading = asdict(s)
            reading["xid_errors_total"] = {str(k): v for k, v in s.xid_errors_total.items()}
            reading["nvlink_errors_total"] = {
                str(k): dict(v) for k, v in s.nvlink_errors_total.items()
            }
            if s.clock_events_active is not None:
                reading["clock_events_active"] = sorted(s.clock_events_active)
            d["health"] = {"state": s.health_state, "action": s.health_action}
            if s.health_reason:
                d["health"]["reason"] = s.health_reason
            d["reading"] = {k: v for k, v in reading.items() if k not in ("index", "uuid")}
        gpus.append(d)
    if args.format == "json":
        json.dump(
            {
                "driver_version": snap.inventory.driver_version,
                "cuda_driver_version": ".".join(map(str, snap.inventory.cuda_driver_version or ())),
                "gpus": gpus,
                "labels": dict(ls.labels),
                "annotations": ls.annotations,
            },
            sys.stdout,
            indent=2,
        )
        print()
        return 0
    print(
        f"{'GPU':>3}  {'NAME':<28} {'MEMORY MiB':>17} {'UTIL':>5} {'TEMP':>5} {'POWER':>7}  HEALTH"
    )
    for info in snap.inventory.gpus:
        s = snap.sample_for(info.index)
        used = f"{s.memory_used_bytes // 2**20}" if s and s.memory_used_bytes is not None else "-"
        util = (
            f"{s.gpu_utilization_ratio:.0%}" if s and s.gpu_utilization_ratio is not None else "-"
        )
        temp = f"{s.temperature_celsius:.0f}C" if s and s.temperature_celsius is not None else "-"
        power = f"{s.power_watts:.0f}W" if s and s.power_watts is not None else "-"
        health = "ok"
        if s is not None and s.health_state != "healthy":
            health = f"{s.health_state.upper()} ({s.health_reason}; action {s.health_action})"
        print(
            f"{info.index:>3}  {info.name[:28]:<28} {used + '/' + str(info.memory_total_mib):>17} "
            f"{util:>5} {temp:>5} {power:>7}  {health}"
        )
    print("\nlabels:")
    for k, v in sorted(ls.labels.items()):
        print(f"  {k}={v}")
    print("annotations:")
    for k, v in ls.annotations.items():
        print(f"  {k}={v[:100]}{'...' if len(v) > 100 else ''} ({len(v)} bytes)")
    return 0


def _check_prefix(prefix: str | None) -> None:
    from gpudaemon.labels.sanitize import validate_prefix

    if prefix is not None:
        try:
            validate_prefix(prefix)
        except ValueError as e:
            raise UsageError(f"--prefix: {e}") from None


def _check_namespace(namespace: str | None) -> None:
    if namespace is not None and not _DNS_LABEL.match(namespace):
        raise UsageError(
            f"-n/--namespace: {namespace[:100]!r} is not a namespace name "
            "(lower-case letters, digits and '-', at most 63)"
        )


def _credentials(kubeconfig: str, in_cluster: bool) -> Credentials:
    """The CLI's clients (status, cleanup) need credentials: none found is a usage error
    naming where they were sought."""
    from gpudaemon.config.environment import where_credentials_were_sought
    from gpudaemon.kube.client import find_credentials

    creds = find_credentials(kubeconfig, in_cluster)
    if creds is None:
        raise UsageError(
            f"no Kubernetes credentials ({where_credentials_were_sought()}): give --kubeconfig"
        )
    return creds


def _status(args: argparse.Namespace) -> int:
    from gpudaemon.config import StatusSettings
    from gpudaemon.kube.client import KubeClient
    from gpudaemon.logsetup import setup_logging
    from gpudaemon.selector import parse_selector
    from gpudaemon.status import as_json, as_table, collect

    setup_logging("WARNING")
    _warn_environment()
    _check_prefix(args.prefix)
    try:
        parse_selector(args.selector)
    except ValueError as e:
        raise UsageError(f"-l/--selector: {e}") from None
    _check_namespace(args.namespace)
    cfg = _load(StatusSettings, args, _overrides(args, _STATUS_FLAGS))
    k = cfg.kubernetes
    creds = _credentials(k.kubeconfig, bool(k.in_cluster))
    # -n, else a lease_namespace set in the config or environment, else found by label.
    namespace = args.namespace or (
        k.lease_namespace if "lease_namespace" in k.model_fields_set else None
    )
    client = KubeClient.from_credentials(creds, k.request_timeout_seconds)
    try:
        rows = collect(
            client,
            prefix=cfg.labels.prefix,
            lease_namespace=namespace,
            fallback_namespace=k.lease_namespace,
            selector=args.selector,
            pool_label=args.pool_label,
        )
    finally:
        client.close()
    print(as_json(rows) if args.output == "json" else as_table(rows), end="")
    if args.output == "json":
        print()
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    from gpudaemon.cleanup import cleanup
    from gpudaemon.config import StatusSettings
    from gpudaemon.kube.client import KubeClient
    from gpudaemon.logsetup import setup_logging

    setup_logging("WARNING")
    _warn_environment()
    _check_prefix(args.prefix)
    _check_namespace(args.namespace)
    cfg = _load(StatusSettings, args, _overrides(args, _STATUS_FLAGS))
    k = cfg.kubernetes
    creds = _credentials(k.kubeconfig, bool(k.in_cluster))
    namespace = args.namespace or k.lease_namespace
    client = KubeClient.from_credentials(creds, k.request_timeout_seconds)
    try:
        report = cleanup(
            client, prefix=cfg.labels.prefix, namespace=namespace, dry_run=args.dry_run
        )
    finally:
        client.close()
    verb = "would remove" if args.dry_run else "removed"
    for line in report.removed:
        print(f"{verb}: {line}")
    for line in report.failed:
        print(f"failed: {line}", file=sys.stderr)
    print(f"{len(report.removed)} {verb}, {len(report.failed)} failed")
    return 1 if report.failed else 0


def _check_config(args: argparse.Namespace) -> int:
    """Each chosen program's model, as its command loads it (the same file, the same
    GPUDAEMON_* variables and environment defaults; no flags): the first failure is
    one line naming the program and the key, exit 2."""
    from gpudaemon.config import PROGRAMS as MODELS
    from gpudaemon.config import check_files, load_settings
    from gpudaemon.errors import ConfigError
    from gpudaemon.logsetup import setup_logging

    setup_logging("WARNING")
    _warn_environment()
    names = list(PROGRAMS) if args.program == "all" else [args.program]
    for name in names:
        try:
            cfg = load_settings(MODELS[name], args.config)
            if args.files:
                check_files(cfg)
        except UsageError as e:
            raise ConfigError(f"{name}: {e}") from None
    where = args.config or "the environment (no --config)"
    print(f"{where}: valid for {', '.join(names)}")
    return 0
