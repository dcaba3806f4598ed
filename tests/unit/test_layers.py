"""Layers run one way (issues 23 and 29): configuration sits below everything that reads
it; the shared layers (cluster, kube, labels, ...) import no program; no program imports
another program. Checked on the imports of every module, lazy and TYPE_CHECKING ones
included, so a future back-arrow fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "gpudaemon"


def imported_modules(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize(
    "above",
    [
        "gpudaemon.kube",
        "gpudaemon.history",
        "gpudaemon.cluster",
        "gpudaemon.agent",
        "gpudaemon.extender",
        "gpudaemon.rebalancer",
        "gpudaemon.status",
    ],
)
def test_config_imports_nothing_from_the_layers_above_it(above: str) -> None:
    files = sorted((PKG / "config").glob("*.py"))
    assert len(files) >= 8, "gpudaemon/config/ not found"
    for path in files:
        mods = imported_modules(path)
        assert mods, f"{path.name} imports nothing at all? the parser is broken"
        assert not [m for m in mods if m == above or m.startswith(above + ".")], path.name


def bench_imports_in_tests() -> list[str]:
    tests = PKG.parent / "tests"
    files = sorted(tests.rglob("*.py"))
    assert len(files) > 50, "tests/ not found"
    return [
        f"{path.relative_to(PKG.parent)}: {mod}"
        for path in files
        for mod in sorted(imported_modules(path))
        if mod == "bench" or mod.startswith("bench.")
    ]


def test_tests_never_import_bench() -> None:
    """Benches may use the test harness (tests/support.py, fakes, builders); tests never
    import bench/ (issue 29): what both need lives in tests/ (tests/kubeobjects.py,
    tests/unit/rebalancer/fleet.py) or in the package."""
    assert bench_imports_in_tests() == []


def test_no_bench_imports_the_wiring_even_through_a_test_helper() -> None:
    """bench/ measures library modules, never gpudaemon.agent.app; a helper of tests/ that a
    bench imports counts too (it would bring the wiring in through the back door)."""
    bench = PKG.parent / "bench"
    seen: set[Path] = set()
    todo = sorted(bench.glob("*.py"))
    assert len(todo) > 5, "bench/ not found"
    offenders = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for mod in imported_modules(path):
            if mod == "gpudaemon.agent.app":
                offenders.append(path.relative_to(PKG.parent))
            elif mod.split(".")[0] in ("bench", "tests"):
                f = PKG.parent / (mod.replace(".", "/") + ".py")
                if f.exists():
                    todo.append(f)
    assert offenders == []


# Shared modules at the package root: what every program may import (config/ and
# httpserver/ are packages: every module in them sits in this layer).
ROOT = {
    "__init__", "errors", "model", "logsetup", "selector", "incluster", "textfile",
    "httpserver", "schedule", "catalogue", "config", "lazyimport", "runtime",
}  # fmt: skip
# Each layer (a sub-package, or a module named here) and the layers it may import; a
# layer may always import itself. Programs: agent, extender, rebalancer, status (cli is
# the dispatcher that starts them). Shared layers never import a program.
PROGRAM_LAYERS = {"agent", "extender", "rebalancer", "status"}
ALLOWED: dict[str, set[str]] = {
    # config checks the label prefix (labels/sanitize.py); the metric catalogue names the
    # health signals' values (health/signals.py, health/verdict.py)
    "root": {"labels", "health"},
    "health": {"root"},  # signal -> state -> action tables: pure, read by backends and agent
    # the reset tool's result (remediation/nvsmi.py): every backend resets a GPU
    "backends": {"root", "health", "remediation"},
    # resetting a GPU in place: the grant and the tool, shared by agent and rebalancer
    "remediation": {"root", "labels", "kube"},
    "labels": {"root"},
    "kube": {"root"},
    "history": {"root"},
    "podresources": {"root"},
    "cluster": {"root", "labels", "kube"},
    "agent": {
        "root",
        "backends",
        "health",
        "labels",
        "kube",
        "history",
        "podresources",
        "remediation",
    },
    "extender": {"root", "labels", "kube", "cluster"},
    "rebalancer": {"root", "labels", "kube", "cluster", "remediation"},
    "status": {"root", "labels", "kube", "cluster"},
    # cli's --help names what the registries hold: profiles (backends), policies (cluster)
    "cli": {"root", "backends", "labels", "kube", "cluster", *PROGRAM_LAYERS},
}
PROGRAMS = ("agent", "extender", "rebalancer", "status")


def layer_of(module: str) -> str:
    """The layer of a dotted module under gpudaemon; unknown ones fail so that a new
    top-level module has to be placed in the table."""
    parts = module.split(".")[1:] or ["__init__"]
    head = parts[0]
    # `gpudaemon cleanup` undoes what every program wrote: a command of the dispatcher's.
    if head in ("cli", "__main__", "cleanup"):
        return "cli"
    if head in ROOT:
        return "root"
    if head in ALLOWED:
        return head
    raise AssertionError(f"gpudaemon.{head} is in no layer: add it to ROOT or ALLOWED")


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def gpudaemon_imports(path: Path) -> set[str]:
    """Every gpudaemon module `path` imports, relative imports resolved, and
    `from gpudaemon.x import y` counted as gpudaemon.x.y when y is a module."""
    here = module_name(path).split(".") if path.is_relative_to(PKG) else []
    if here and path.name != "__init__.py":
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here[: len(here) - node.level + 1]
                base = ".".join([*pkg, *([base] if base else [])])
            out.add(base)
            for a in node.names:
                sub = PKG.parent / (base.replace(".", "/") + "/" + a.name)
                if sub.with_suffix(".py").exists() or sub.is_dir():
                    out.add(f"{base}.{a.name}")
    return {m for m in out if m == "gpudaemon" or m.startswith("gpudaemon.")}


def all_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "_gen" not in p.parts)


def test_the_table_covers_every_module() -> None:
    mods = all_modules()
    assert len(mods) > 50, "gpudaemon/ not found"
    layers = {layer_of(module_name(p)) for p in mods}
    assert set(PROGRAMS) <= layers
    assert {"cluster", "kube", "labels", "backends", "history"} <= layers


def test_every_import_follows_the_layer_table() -> None:
    back_arrows = []
    for path in all_modules():
        mine = layer_of(module_name(path))
        for mod in gpudaemon_imports(path):
            theirs = layer_of(mod)
            if theirs != mine and theirs not in ALLOWED[mine]:
                back_arrows.append(f"{path.relative_to(PKG.parent)} -> {mod}")
    assert back_arrows == []


def test_no_shared_layer_or_program_imports_another_program() -> None:
    """The table itself says so: only cli starts programs."""
    for layer, allowed in ALLOWED.items():
        if layer != "cli":
            assert not (allowed & set(PROGRAMS)), layer


def test_the_check_sees_a_lazy_back_arrow(tmp_path: Path) -> None:
    """The parser finds an import hidden in a function body, as a planner importing
    the extender's wiring would be."""
    f = tmp_path / "planner.py"
    f.write_text("def f():\n    from gpudaemon.extender.app import Extender\n")
    assert "gpudaemon.extender.app" in gpudaemon_imports(f)
    assert layer_of("gpudaemon.extender.app") not in ALLOWED["rebalancer"]


@pytest.mark.parametrize("name", ["planner", "fits", "drain"])
def test_the_rebalancers_rules_stay_pure(name: str) -> None:
    """planner.py, drain.py and fits.py decide; they never reach the API, the HTTP
    server, the series or the wiring (app, passes, actions, state, metrics, ratelimit)."""
    mods = imported_modules(PKG / "rebalancer" / f"{name}.py")
    impure = ("gpudaemon.kube", "gpudaemon.httpserver", "prometheus_client", "loguru")
    assert not [m for m in mods if m.startswith(impure)]
    assert {m for m in mods if m.startswith("gpudaemon.rebalancer")} <= {
        "gpudaemon.rebalancer.fits",
        "gpudaemon.rebalancer.planner",
    } - {f"gpudaemon.rebalancer.{name}"}


@pytest.mark.parametrize(
    ("package", "owners"),
    [
        ("kubernetes", {"kube/client.py", "kube/incluster.py"}),
        ("influxdb_client", {"history/transport.py"}),
    ],
)
def test_each_client_package_has_one_boundary(package: str, owners: set[str]) -> None:
    """One module per outside system (docs/architecture.md): the official clients are
    imported there and nowhere else, so their errors are mapped to ours in one place."""
    importers = {
        str(p.relative_to(PKG))
        for p in PKG.rglob("*.py")
        if "_gen" not in p.parts
        and any(m == package or m.startswith(package + ".") for m in imported_modules(p))
    }
    assert importers == owners
