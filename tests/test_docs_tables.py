"""Every docs table marked ``<!-- table: python benchmarks/<script>.py --table <results>.json -->`` is, row for row,
what that command prints from the JSON it names: a table and its results file cannot drift apart. The commands only
read JSON (no measurement), so they run in seconds."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- table: (python benchmarks/[\w.]+\.py --table [^>]*?) -->\n((?:\|.*\n?)+)", re.M)


def marked_tables(text: str) -> list[tuple[str, str]]:
    """``(command, table)`` of every marked table of a page."""
    return [(m.group(1), m.group(2).strip()) for m in MARK.finditer(text)]


TABLES = [
    pytest.param(cmd, table, id=f"{page.name}:{cmd.split()[-1].rsplit('/', 1)[-1]}")
    for page in PAGES
    for cmd, table in marked_tables(page.read_text(encoding="utf8"))
]


def test_the_marked_tables_are_found():
    page = "x\n<!-- table: python benchmarks/a.py --table b.json -->\n| a |\n|---|\n| 1 |\n\nmore\n"
    assert marked_tables(page) == [("python benchmarks/a.py --table b.json", "| a |\n|---|\n| 1 |")]
    assert {c.split()[-1] for c, _ in (p.values[:2] for p in TABLES)} >= {
        "benchmarks/results/mol_topk_recipe_1m.json",
        "benchmarks/results/index_scale.json",
    }


@pytest.mark.parametrize("command, table", TABLES)
def test_docs_table_is_its_json(command, table):
    argv = shlex.split(command)
    out = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert table.splitlines() == printed, f"the table differs from what `{command}` prints"
