"""Plug-in packages (scoring policies, extender plug-ins) register each module on
import: importing every module of the package is what makes a new file count, with no
other edit (kube-scheduler's registry.go, as a directory)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable


def import_modules(package: str, path: Iterable[str], skip: str = "base") -> None:
    """Import every module of `package` (at `path`) but `skip`, which holds the registry."""
    for mod in pkgutil.iter_modules(list(path)):
        if mod.name != skip:
            importlib.import_module(f"{package}.{mod.name}")
