"""Lazy package `__init__`s (gpudaemon/lazyimport.py): only an `__init__` of imports and
constants is deferred, every name it would bind still resolves, and the libraries the
agent loads this way load a fraction of their modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpudaemon.lazyimport import _LazyFinder, lazy_names


def test_imports_and_constants_are_deferred_and_anything_else_is_not() -> None:
    src = '"""doc"""\nfrom .a import X\nfrom . import sub\nfrom pkg.b import Y as Z\n'
    src += "__all__ = ['X']\nVERSION_ALIAS = X\n"
    found = lazy_names(src, "pkg")
    assert found is not None
    names, constants = found
    assert names == {
        "X": ("pkg.a", "X"),
        "sub": ("pkg.sub", None),
        "Z": ("pkg.b", "Y"),
        "VERSION_ALIAS": ("pkg.a", "X"),
    }
    assert constants == {"__all__": ["X"]}
    for code in ("def f(): pass", "from .a import *", "import os", "if True: pass", "x = f()"):
        assert lazy_names(code, "pkg") is None, code


def test_a_lazy_package_resolves_its_names_on_first_use(tmp_path: Path) -> None:
    pkg = tmp_path / "lazypkg_t"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from .heavy import Thing\nfrom . import other\n__version__ = '1.0'\n"
    )
    (pkg / "heavy.py").write_text("import builtins\nbuiltins.HEAVY_LOADED = True\nThing = 42\n")
    (pkg / "other.py").write_text("VALUE = 'o'\n")
    (pkg / "light.py").write_text("LIGHT = 1\n")
    finder = _LazyFinder(frozenset({"lazypkg_t"}))
    sys.path.insert(0, str(tmp_path))
    sys.meta_path.insert(0, finder)
    try:
        import builtins

        import lazypkg_t.light  # type: ignore[import-not-found]

        assert lazypkg_t.light.LIGHT == 1
        assert lazypkg_t.__version__ == "1.0"
        assert not getattr(builtins, "HEAVY_LOADED", False)  # the __init__ did not run
        from lazypkg_t import Thing  # type: ignore[import-not-found]

        assert Thing == 42 and builtins.HEAVY_LOADED  # type: ignore[attr-defined]
        assert lazypkg_t.other.VALUE == "o"
        with pytest.raises(AttributeError, match="no attribute 'nope'"):
            _ = lazypkg_t.nope
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m.startswith("lazypkg_t")]:
            del sys.modules[m]
        if hasattr(__import__("builtins"), "HEAVY_LOADED"):
            del __import__("builtins").HEAVY_LOADED


PROBE = """
import sys
{install}
from influxdb_client import Point, InfluxDBClient, WritePrecision
import kubernetes
from kubernetes import client, config
assert Point and InfluxDBClient and WritePrecision.MS == "ms" and client.ApiClient
assert kubernetes.watch.Watch  # a name the package __init__ binds, resolved on use
print(len(sys.modules))
"""


def _modules(install: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(install=install)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip())


def test_the_clients_load_lazily_with_every_name_still_there() -> None:
    eager = _modules("")
    lazy = _modules("from gpudaemon import lazyimport; lazyimport.install()")
    assert lazy < eager - 100, (lazy, eager)
