"""No private name crosses a module boundary: no module of pyterrier_prob, st_extensions or benchmarks imports a
``_name`` of one of our modules (``from m import _name``) or reads one as a module attribute (``m._name``, where ``m``
is one of our modules bound by an import). A name a second module needs is public, documented where it lives."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("pyterrier_prob", "st_extensions", "benchmarks")
OURS = ("pyterrier_prob", "st_extensions", "benchmarks")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def crossings(path: Path, root: Path = ROOT) -> list[str]:
    """``"file:line: what"`` for every private name of another of our modules (under ``root``) that ``path`` uses."""
    name, tree = _module_name(path, root), ast.parse(path.read_text(encoding="utf8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    modules: dict[str, str] = {}  # local name -> our module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not _is_ours(base):
                continue
            for alias in node.names:
                if _private(alias.name) and base != name:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: from {base} import {alias.name}")
                modules[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ours(alias.name):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.asname and alias.name or alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            head = node.value
            chain = []
            while isinstance(head, ast.Attribute):
                chain.append(head.attr)
                head = head.value
            if isinstance(head, ast.Name) and head.id in modules:
                target = ".".join([modules[head.id], *reversed(chain)])
                where = root / Path(*target.split("."))
                if target != name and (where.with_suffix(".py").exists() or (where / "__init__.py").exists()):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {target}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module():
    found = [c for pkg in SCANNED for path in sorted((ROOT / pkg).rglob("*.py")) for c in crossings(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_check_finds_both_kinds(tmp_path):
    """A planted module that imports a private name and one that reads it as an attribute are both reported."""
    pkg = tmp_path / "benchmarks"
    pkg.mkdir()
    (pkg / "a.py").write_text("_hidden = 1\n")
    (pkg / "b.py").write_text("from benchmarks.a import _hidden\nfrom benchmarks import a\nx = a._hidden\n")
    found = crossings(pkg / "b.py", tmp_path)
    assert found == ["benchmarks/b.py:1: from benchmarks.a import _hidden", "benchmarks/b.py:3: benchmarks.a._hidden"]


def test_loading_refuses_versions_whose_internals_it_was_not_written_for():
    """st_extensions.load_model calls sentence-transformers' and transformers' internals: outside the supported
    versions it says which package, which version and what to install; the installed ones pass."""
    import pytest

    from st_extensions.loading import SUPPORTED, check_internals

    check_internals()
    assert SUPPORTED == {"sentence-transformers": ("6.2", "7"), "transformers": ("5.24", "6")}
    with pytest.raises(RuntimeError, match=r"sentence-transformers that it was written for 6.2 <= version < 7; 7.0.1"):
        check_internals({"sentence-transformers": "7.0.1"})
    with pytest.raises(RuntimeError, match=r"transformers>=5.24,<6"):
        check_internals({"transformers": "4.57.0"})
