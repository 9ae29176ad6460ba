"""Every docs table marked ``<!-- table: python benchmarks/<script>.py --table <results>.json -->`` is, row for row,
what that command prints from the JSON it names: a table and its results file cannot drift apart. The commands only
read JSON (no measurement); one child process runs them all, each as ``python <script> ...`` would (``__main__``, its
folder first on ``sys.path``), so the libraries are imported once, not once a table."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!-- table: (python benchmarks/[\w.]+\.py --table [^>]*?) -->\n((?:\|.*\n?)+)", re.M)

# Runs each command's script in this child as `python <script> <args>` would, and answers
# {command: [exit status, stdout, the end of its traceback]} as JSON on the last line of stdout.
RUNNER = r"""
import contextlib, io, json, os, runpy, shlex, sys, traceback
results, base = {}, list(sys.path[1:])
for command in json.loads(sys.argv[1]):
    argv = shlex.split(command)[1:]
    sys.argv, sys.path[:] = argv, [os.path.dirname(os.path.abspath(argv[0])), *base]
    out, status, error = io.StringIO(), 0, ""
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:
            status, error = 1, traceback.format_exc()[-2000:]
    results[command] = [status, out.getvalue(), error]
print(json.dumps(results))
"""


def marked_tables(text: str) -> list[tuple[str, str]]:
    """``(command, table)`` of every marked table of a page."""
    return [(m.group(1), m.group(2).strip()) for m in MARK.finditer(text)]


TABLES = [
    pytest.param(cmd, table, id=f"{page.name}:{cmd.split()[-1].rsplit('/', 1)[-1]}")
    for page in PAGES
    for cmd, table in marked_tables(page.read_text(encoding="utf8"))
]


def run_commands(commands: list[str]) -> dict[str, list]:
    """``{command: [exit status, stdout, traceback]}`` of each command, all run in one child process."""
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(commands)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def printed() -> dict[str, list]:
    return run_commands(sorted({p.values[0] for p in TABLES}))


def test_the_marked_tables_are_found():
    page = "x\n<!-- table: python benchmarks/a.py --table b.json -->\n| a |\n|---|\n| 1 |\n\nmore\n"
    assert marked_tables(page) == [("python benchmarks/a.py --table b.json", "| a |\n|---|\n| 1 |")]
    assert {c.split()[-1] for c, _ in (p.values[:2] for p in TABLES)} >= {
        "benchmarks/results/mol_topk_recipe_1m.json",
        "benchmarks/results/index_scale.json",
    }


def test_the_runner_reports_a_failing_command_and_runs_the_next(tmp_path):
    """A command that fails is reported with its status and traceback, and does not stop the ones after it; each
    script sees its own argv and its own folder first on ``sys.path``, as under ``python <script>``."""
    (tmp_path / "ok.py").write_text("import sys\nprint('|', sys.argv[1:], sys.path[0] == __file__.rsplit('/', 1)[0])\n")
    (tmp_path / "bad.py").write_text("raise ValueError('no such table')\n")
    (tmp_path / "exits.py").write_text("raise SystemExit(3)\n")
    commands = [f"python {tmp_path / name} --table x.json" for name in ("bad.py", "exits.py", "ok.py")]
    got = run_commands(commands)
    assert got[commands[0]][0] == 1 and "ValueError: no such table" in got[commands[0]][2]
    assert got[commands[1]][0] == 3
    assert got[commands[2]] == [0, "| ['--table', 'x.json'] True\n", ""]


@pytest.mark.parametrize("command, table", TABLES)
def test_docs_table_is_its_json(command, table, printed):
    status, stdout, error = printed[command]
    assert status == 0, error
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    assert table.splitlines() == lines, f"the table differs from what `{command}` prints"
