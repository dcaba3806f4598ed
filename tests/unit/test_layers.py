"""Layers run one way (issue 23): configuration sits below everything that reads it and
imports none of the Kubernetes, history or extender layers, or the wiring, not even
lazily inside a function."""

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
    "above", ["gpudaemon.kube", "gpudaemon.history", "gpudaemon.extender", "gpudaemon.app"]
)
def test_config_imports_nothing_from_the_layers_above_it(above: str) -> None:
    mods = imported_modules(PKG / "config.py")
    assert mods, "config.py imports nothing at all? the parser is broken"
    assert not [m for m in mods if m == above or m.startswith(above + ".")]


def test_no_bench_imports_the_wiring_even_through_a_test_helper() -> None:
    """bench/ measures library modules, never gpudaemon.app; a helper of tests/ that a
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
            if mod == "gpudaemon.app":
                offenders.append(path.relative_to(PKG.parent))
            elif mod.split(".")[0] in ("bench", "tests"):
                f = PKG.parent / (mod.replace(".", "/") + ".py")
                if f.exists():
                    todo.append(f)
    assert offenders == []


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
