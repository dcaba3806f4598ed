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
