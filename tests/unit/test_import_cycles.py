"""No import cycles in gpudaemon: the graph of which module imports which has no cycle.

Every import counts: at module level, under `if TYPE_CHECKING:`, and inside functions
(lazy ones). A cycle cannot then be hidden by moving one of its imports into a
function or a type-checking block, as config/ and backends/simulated/ had done. A
module's import of a package's name (`from gpudaemon.config import Config`) is an edge
to that package's `__init__`; `from pkg import mod` is an edge to the submodule. The
implicit import of a module's own parent packages is not an edge (every submodule
would otherwise close a cycle with an `__init__` that re-exports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "gpudaemon"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PKG) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text."""
    root = package_dir.parent
    modules = {module_name(p, root): p for p in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, `level - 1` up
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in modules:
                        out.add(sub)
                    elif base in modules:
                        out.add(base)
        out.discard(name)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative),
    each sorted: every import cycle lies inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_gpudaemon_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100 and "gpudaemon.config.programs" in graph["gpudaemon.config"]
    found = cycles(graph)
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert found == [], detail


def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_a_lazy_or_type_checking_import_closes_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.sub import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from pkg.sub.c import x\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n"
    )
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.sub.a"}
    assert cycles(graph) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]
