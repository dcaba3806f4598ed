"""Every pynvml name the NVML backend package uses exists in the installed nvidia-ml-py, and
every call passes arguments its signature accepts.

No GPU is needed: the source of every module in gpudaemon/backends/nvml/ (the one
package that calls pynvml) is read with `ast`, so a name used on a code path
CI never runs (no NVML here) is still checked. A typo or a binding that dropped or
changed a function fails this test instead of a GPU node in production.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pynvml
import pytest

import gpudaemon.backends.nvml as backend

PACKAGE = Path(backend.__file__).parent
# (module file name, its syntax tree), for every module of the package.
# The XID event loop (backends/xidevents.py) is run over pynvml too, so it is read as well.
TREES = [
    (p.name, ast.parse(p.read_text()))
    for p in [*sorted(PACKAGE.glob("*.py")), PACKAGE.parent / "xidevents.py"]
]
# How the backend refers to the pynvml module: `n = self._nvml`, `self._nvml`, or the
# module handed to a helper as `n`.
_MODULE_NAMES = {"n", "nvml"}


def _is_module(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _MODULE_NAMES
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "_nvml"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _names() -> set[str]:
    """Every attribute read from the module: functions, constants, NVMLError, structs."""
    return {
        node.attr
        for _, tree in TREES
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_module(node.value)
    }


def _calls() -> list[tuple[str, int, str]]:
    """(function, positional argument count, file:line) for every call of a pynvml function:
    direct (`n.nvmlInit()`) and by name (`self._call("fn", *args)`,
    `self._read(index, what, "fn", *args)`)."""
    out = []
    for file, tree in TREES:
        out += _calls_in(file, tree)
    return out


def _calls_in(file: str, tree: ast.Module) -> list[tuple[str, int, str]]:
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and _is_module(f.value) and f.attr.startswith("nvml"):
            out.append((f.attr, len(node.args), f"{file}:{node.lineno}"))
        elif isinstance(f, ast.Attribute) and f.attr in ("_call", "_read"):
            at = 0 if f.attr == "_call" else 2  # _read(index, what, fn, ...)
            name = node.args[at]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                out.append((name.value, len(node.args) - at - 1, f"{file}:{node.lineno}"))
    return out


NAMES = sorted(_names() | {c[0] for c in _calls()})
CALLS = _calls()


def test_the_source_scan_finds_the_backend_s_names() -> None:
    # Guards the scan itself: if the backend changed how it reaches pynvml, these vanish.
    assert {"nvmlInit", "nvmlDeviceGetFieldValues", "NVMLError", "NVML_ERROR_GPU_IS_LOST"} <= set(
        NAMES
    )
    assert len(CALLS) > 25
    # ... in every module of the package: the scan covers each (a module that stopped
    # being scanned would hide its names).
    assert {c[2].split(":")[0] for c in CALLS} == {
        "library.py",
        "backend.py",
        "healthreads.py",
        "gpmreads.py",
        "xidevents.py",
    }


@pytest.mark.parametrize("name", NAMES)
def test_name_exists_in_installed_pynvml(name: str) -> None:
    assert hasattr(pynvml, name), f"pynvml has no {name} (nvidia-ml-py {_version()})"


@pytest.mark.parametrize(("fn", "nargs", "line"), CALLS, ids=[f"{c[0]}@{c[2]}" for c in CALLS])
def test_call_shape_matches_the_signature(fn: str, nargs: int, line: str) -> None:
    sig = inspect.signature(getattr(pynvml, fn))
    try:
        sig.bind(*([None] * nargs))
    except TypeError as e:
        pytest.fail(f"{line}: {fn}{sig} called with {nargs} argument(s): {e}")


def test_a_misspelt_or_misshapen_call_would_fail() -> None:
    """The checks above can fail: a wrong name is missing, a wrong arity does not bind."""
    assert not hasattr(pynvml, "nvmlDeviceGetTemprature")
    with pytest.raises(TypeError):
        inspect.signature(pynvml.nvmlDeviceGetTemperature).bind(None)


def _version() -> str:
    from importlib.metadata import version

    return version("nvidia-ml-py")
