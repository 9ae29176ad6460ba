"""No import cycles in pyterrier_prob or st_extensions, counting imports inside functions too; and the one direction
of DESIGN.md: st_extensions never imports pyterrier_prob (nor PyTerrier)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pyterrier_prob", "st_extensions")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its body (``from a import b`` counts ``a.b`` if a module)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules:  # import a.b.c of a non-module attribute: the deepest module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_ancestor_edge(a: str, b: str) -> bool:
    """A package importing its own submodule (a re-export): the submodule importing its parent package back would
    still close a cycle, so only this direction is dropped."""
    return b.startswith(a + ".")


def test_graph_is_found():
    g = _graph()
    assert "pyterrier_prob.experiments.harness" in g
    assert "pyterrier_prob.index.indexer" in g["pyterrier_prob.index.dense"]
    assert "st_extensions.defaults" in g["st_extensions.pebr"]


def test_no_import_cycles():
    g = _graph()
    # ignore package -> own-submodule edges (re-exports); every other cycle is a real one
    pruned = {a: {b for b in bs if not _is_ancestor_edge(a, b)} for a, bs in g.items()}
    assert _cycles(pruned) == []


def test_cycle_detector_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_st_extensions_knows_nothing_of_pyterrier():
    for path in (ROOT / "st_extensions").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                assert not n.startswith(("pyterrier", "pyterrier_prob")), f"{path} imports {n}"
