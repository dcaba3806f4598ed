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
    "above", ["gpudaemon.kube", "gpudaemon.history", "gpudaemon.extender", "gpudaemon.agent.app"]
)
def test_config_imports_nothing_from_the_layers_above_it(above: str) -> None:
    mods = imported_modules(PKG / "config.py")
    assert mods, "config.py imports nothing at all? the parser is broken"
    assert not [m for m in mods if m == above or m.startswith(above + ".")]


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
