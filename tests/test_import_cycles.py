"""No import cycles in pyterrier_prob or st_extensions, counting imports inside functions (not type-only ones under
``if TYPE_CHECKING:``) and package-level edges; and the one direction of DESIGN.md: st_extensions never imports
pyterrier_prob (nor PyTerrier)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pyterrier_prob", "st_extensions")


def _modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    mods = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those inside ``if TYPE_CHECKING:`` (type-only imports, which never run)."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        out.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``name`` imports anywhere in its body but under ``if TYPE_CHECKING:`` (``from a import b``
    counts ``a.b`` if a module).

    Importing ``a.b.c`` also runs the ``__init__`` of packages ``a`` and ``a.b``: an edge to each of them, except to
    the packages that hold ``name`` itself (they are imported before it, so they cannot wait on it). A package's
    ``__init__`` importing its own submodules is an edge like any other."""
    is_pkg = path.name == "__init__.py"
    own = {*_ancestors(name), name}
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf8"))):
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
            out.update(m for m in (*_ancestors(t), t) if m and m in modules and m not in own)
    return out


def _graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    modules = _modules(root, packages)
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


def test_graph_is_found():
    g = _graph()
    assert "pyterrier_prob.experiments.harness" in g
    assert "pyterrier_prob.index.indexer" in g["pyterrier_prob.index.dense"]
    assert "st_extensions.defaults" in g["st_extensions.pebr"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_package_level_cycle_is_found(tmp_path):
    """A package's ``__init__`` importing a submodule that (inside a function) imports a module which imports
    another submodule of that package: a cycle only through the package's ``__init__``."""
    files = {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from pkg.sub.a import f\n",
        "pkg/sub/a.py": "def f():\n    from pkg.other import h\n    return h\n",
        "pkg/sub/b.py": "X = 1\n",
        "pkg/other.py": "from pkg.sub.b import X\n\n\ndef h():\n    return X\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.sub.a import f\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    g = _graph(tmp_path, ("pkg",))
    assert g["pkg.other"] == {"pkg.sub", "pkg.sub.b"}  # importing pkg.sub.b runs pkg.sub's __init__
    assert g["pkg.sub.a"] == {"pkg.other"}  # not its own package pkg.sub, imported before it
    assert g["pkg.typed"] == set()  # a type-only import never runs
    assert _cycles(g) == [["pkg.other", "pkg.sub", "pkg.sub.a"]]


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
