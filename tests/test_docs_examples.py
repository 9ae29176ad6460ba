"""Every python block of README.md and docs/*.md runs as a user would copy it.

Each block is written to a file in a fresh temporary folder and run there in its own Python process, so a block
cannot lean on another block's names or files; it must exit with status 0 within the timeout, and a first stage
that retrieves nothing for most queries (``EmptyRetrievalWarning``) is an error. Blocks in other languages (bash
commands, tables) are not run.
"""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
TIMEOUT_S = 600
#: The most training steps a block may ask for: the examples train on an explicit small budget.
MAX_STEPS = 200


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line of the opening fence, code)`` of every fenced python block of a Markdown file."""
    text = path.read_text(encoding="utf8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = [
    pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}") for path in PAGES for line, code in python_blocks(path)
]


def test_collector_finds_the_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\nprint(y)\n```\n")
    assert python_blocks(page) == [(2, "x = 1\n"), (9, "y = 2\nprint(y)\n")]


def test_readme_has_one_example_per_paper():
    code = "\n".join(c for _, c in python_blocks(ROOT / "README.md"))
    for name in ("CDFCutoffRetriever", "MoLRetriever", "VarCrossEncoderReranker", "MultiBranchRetriever"):
        assert name in code, f"no README python block uses {name}"


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_no_issue_numbers_in_user_facing_text(path):
    found = re.findall(r"(?i)\b(?:issue|PR|pull request)\s*#\d+", path.read_text(encoding="utf8"))
    assert not found, f"{path.name} refers to {found}: a reader cannot look those up"


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(path):
    text = path.read_text(encoding="utf8")
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
        assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


@pytest.mark.parametrize("code", [p.values[0] for p in BLOCKS], ids=[p.id for p in BLOCKS])
def test_training_budget_is_explicit_and_small(code):
    if "fine_tune(" not in code:
        return
    steps = [int(s) for s in re.findall(r"\bsteps=(\d+)", code)]
    assert steps, "a block that trains must state its steps (Recipe(steps=...))"
    assert max(steps) <= MAX_STEPS, f"a block trains {max(steps)} steps; the examples stay at <= {MAX_STEPS}"


def run_block(code: str, folder: pathlib.Path) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``code`` as ``folder/block.py`` in its own Python process, from ``folder``; the process and its wall time.

    An :class:`~pyterrier_prob.validation.EmptyRetrievalWarning` (a first stage that retrieved nothing for most
    queries) is an error there: an example must return results.
    """
    script = folder / "block.py"
    script.write_text(code, encoding="utf8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the installed package, as a user has it
    # the block runs as a script (runpy, __main__) once the warning filter is set (-W cannot name our class)
    runner = (
        "import runpy, sys, warnings\n"
        "from pyterrier_prob.validation import EmptyRetrievalWarning\n"
        "warnings.simplefilter('error', EmptyRetrievalWarning)\n"
        "sys.argv = [sys.argv[1]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    command = [sys.executable, "-c", runner, str(script)]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc, time.perf_counter() - start


def test_an_empty_first_stage_fails_the_block(tmp_path):
    ok, _ = run_block("print('fine')\n", tmp_path)
    assert ok.returncode == 0 and ok.stdout == "fine\n"
    code = "import warnings\nfrom pyterrier_prob.validation import EmptyRetrievalWarning\n"
    code += "warnings.warn(EmptyRetrievalWarning('20 of 20 queries retrieved nothing'))\n"
    failed, _ = run_block(code, tmp_path)
    assert failed.returncode != 0 and "20 of 20 queries retrieved nothing" in failed.stderr


@pytest.mark.slow
@pytest.mark.parametrize("code", [p.values[0] for p in BLOCKS], ids=[p.id for p in BLOCKS])
def test_block_runs_as_copied(code, tmp_path):
    try:
        proc, wall = run_block(code, tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the block ran past {TIMEOUT_S} s; its stderr:\n{(e.stderr or b'')[-4000:]!r}")
    print(f"wall time {wall:.1f} s")
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} after {wall:.1f} s\n--- stdout ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
