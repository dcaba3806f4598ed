"""Load a library's package `__init__` lazily, for the agent's memory budget.

`influxdb_client/__init__.py` imports every generated service and domain model (over
370 import statements), and `kubernetes/__init__.py` imports its dynamic client,
watch, stream, leader election and informer packages; Python runs a package's
`__init__` before any of its submodules, so the few modules we use cannot be had
without them. For the packages named here, an `__init__` made only of imports and
constants is not run: its module resolves each name it would have imported on first
use (PEP 562's module `__getattr__`), as kubernetes 37 already does for its models. An
`__init__` with anything else in it (a function, a condition) is run as usual, so a
new release of a library can only cost memory, never behaviour. Measured in
docs/benchmarks.md (bench/memory); the libraries are still the ones on the write path.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

# The packages whose `__init__` is loaded lazily when it qualifies. Subpackages are
# named one by one: kubernetes.client and kubernetes.config have code of their own.
LAZY_PACKAGES = frozenset(
    {
        "influxdb_client",
        "influxdb_client.client",
        "influxdb_client.client.write",
        "influxdb_client.domain",
        "influxdb_client.service",
        "kubernetes",
    }
)

_installed = False
_lock = threading.Lock()


def install() -> None:
    """Put the finder first on `sys.meta_path`, once; packages imported before it are
    left as they are."""
    global _installed
    with _lock:
        if not _installed:
            sys.meta_path.insert(0, _LazyFinder(LAZY_PACKAGES))
            _installed = True


# An imported name: (module to import, attribute of it, or None for the module itself).
Target = tuple[str, str | None]


def lazy_names(source: str, package: str) -> tuple[dict[str, Target], dict[str, Any]] | None:
    """What an `__init__` binds, if it is only imports and constants: each imported
    name's target, and each constant's value. None when it does anything else."""
    names: dict[str, Target] = {}
    constants: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            for alias in node.names:
                if alias.name == "*":
                    return None
                bound = alias.asname or alias.name
                # `from . import client`: the submodule; `from .x import y`: an attribute.
                names[bound] = (
                    (f"{base}.{alias.name}", None) if node.module is None else (base, alias.name)
                )
            continue
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            target = node.targets[0].id
            if isinstance(node.value, ast.Name) and node.value.id in names:
                names[target] = names[node.value.id]  # `__version__ = VERSION`
                continue
            try:
                constants[target] = ast.literal_eval(node.value)
            except ValueError:
                return None
            continue
        return None
    return names, constants


class _LazyFinder(importlib.abc.MetaPathFinder):
    def __init__(self, packages: frozenset[str]) -> None:
        self.packages = packages

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.packages:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None or spec.submodule_search_locations is None:
            return None
        try:
            with open(spec.origin, encoding="utf-8") as f:
                found = lazy_names(f.read(), fullname)
        except (OSError, SyntaxError, ValueError):
            found = None
        if found is None:
            return None  # code of its own: the usual loader runs it
        spec.loader = _LazyInit(*found)
        return spec


class _LazyInit(importlib.abc.Loader):
    def __init__(self, names: dict[str, Target], constants: dict[str, Any]) -> None:
        self.names, self.constants = names, constants

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        names = self.names
        module.__dict__.update(self.constants)

        def __getattr__(attr: str) -> Any:
            try:
                mod, name = names[attr]
            except KeyError:
                raise AttributeError(
                    f"module {module.__name__!r} has no attribute {attr!r}"
                ) from None
            value = importlib.import_module(mod)
            if name is not None:
                value = getattr(value, name)
            setattr(module, attr, value)  # resolved once
            return value

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
