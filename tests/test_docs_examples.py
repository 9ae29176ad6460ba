"""Every python block of README.md and docs/*.md runs as a user would copy it.

Each block is written to a file in a fresh temporary folder and run there in its own Python process, so a block
cannot lean on another block's names or files; it must exit with status 0 within the timeout, and a first stage
that retrieves nothing for most queries (``EmptyRetrievalWarning``) is an error. Blocks in other languages (bash
commands, tables) are not run.

On Linux each block's process is forked from one that has imported the libraries the blocks use and nothing else
(:data:`ZYGOTE`, as a DataLoader forks its workers), which saves each block those seconds of imports; the block still
runs as a script (``__main__``) with fresh names, from its own folder, its exit status and output its own.
"""

import json
import os
import pathlib
import re
import signal
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


#: Sets the warning filter, then runs the block as a script (runpy, ``__main__``): -W cannot name our class.
RUNNER = (
    "import runpy, sys, warnings\n"
    "from pyterrier_prob.validation import EmptyRetrievalWarning\n"
    "warnings.simplefilter('error', EmptyRetrievalWarning)\n"
    "sys.argv = [sys.argv[1]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
#: The libraries :data:`ZYGOTE` imports before it forks (what the blocks import; the heavy ones).
PRELOADED = ("torch", "sentence_transformers", "pyterrier", "pyterrier_pisa", "ir_datasets", "ir_measures", "faiss")
PRELOADED += ("pyterrier_prob", "st_extensions")
#: Printed by :data:`ZYGOTE` after each block, with the block's exit status.
DONE = "zygote-block-done"
#: A process that imports what the blocks import, then per request (``[folder, script, timeout]`` on stdin) forks a
#: child that runs :data:`RUNNER`'s steps from ``folder`` with its output in ``script.stdout`` / ``script.stderr``,
#: killed by SIGALRM after ``timeout`` seconds; the parent waits and prints :data:`DONE` and the exit status. The
#: child ends as a script's interpreter does (exit status as ``SystemExit`` gives it, a traceback on stderr, atexit
#: handlers run, output flushed) but skips tearing the imported modules down (a second or two with torch loaded).
ZYGOTE = f"""
import atexit, importlib, json, os, runpy, signal, sys, traceback, warnings
from pyterrier_prob.validation import EmptyRetrievalWarning
for name in {PRELOADED!r}:
    try:
        importlib.import_module(name)
    except ImportError:  # an optional library not installed: the blocks that need it say so themselves
        pass
for line in sys.stdin:
    folder, script, timeout = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.chdir(folder)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, name in ((1, script + ".stdout"), (2, script + ".stderr")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        signal.alarm(timeout)
        warnings.simplefilter("error", EmptyRetrievalWarning)
        sys.argv = [script]
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as e:  # as the interpreter reads it
            status = e.code if e.code is None or isinstance(e.code, int) else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            traceback.print_exc()
            status = 1
        atexit._run_exitfuncs()  # what a script's exit runs, without tearing down the imported modules
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status or 0)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    print("{DONE}", status, flush=True)
"""


def block_env() -> dict[str, str]:
    """The environment a block runs in: offline, the installed package as a user has it (no PYTHONPATH)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return env


class Zygote:
    """The :data:`ZYGOTE` process (its stderr in ``log``); :meth:`run` runs one block script in a forked child."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.log = folder / "zygote.stderr"
        with open(self.log, "w") as err:
            argv = [sys.executable, "-c", ZYGOTE]
            self.proc = subprocess.Popen(
                argv, cwd=folder, env=block_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
            )

    def run(self, script: pathlib.Path, timeout: int = TIMEOUT_S) -> int:
        """Exit status of ``script`` run from its folder (negative: the signal that ended it; SIGALRM after
        ``timeout`` seconds)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([str(script.parent), str(script), timeout]) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(DONE):
                return int(line.split()[1])
        raise RuntimeError(f"the zygote process ended (status {self.proc.wait()}): {self.log.read_text()[-4000:]}")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A :class:`Zygote` on Linux (elsewhere, forking after torch and the runtimes loaded is not safe: None, each
    block in a fresh interpreter)."""
    if sys.platform != "linux":
        yield None
        return
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def run_block(
    code: str, folder: pathlib.Path, zygote: Zygote | None = None, timeout: int = TIMEOUT_S
) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``code`` as ``folder/block.py`` in its own Python process, from ``folder`` (forked from ``zygote``, or a
    fresh interpreter); the process and its wall time.

    An :class:`~pyterrier_prob.validation.EmptyRetrievalWarning` (a first stage that retrieved nothing for most
    queries) is an error there: an example must return results. A block that runs past ``timeout`` seconds raises
    ``subprocess.TimeoutExpired``.
    """
    script = folder / "block.py"
    script.write_text(code, encoding="utf8")
    start = time.perf_counter()
    if zygote is None:
        command = [sys.executable, "-c", RUNNER, str(script)]
        proc = subprocess.run(command, cwd=folder, env=block_env(), capture_output=True, text=True, timeout=timeout)
        return proc, time.perf_counter() - start
    status = zygote.run(script, timeout)
    wall = time.perf_counter() - start
    out, err = (pathlib.Path(f"{script}.{name}").read_text(encoding="utf8") for name in ("stdout", "stderr"))
    if status == -signal.SIGALRM:
        raise subprocess.TimeoutExpired(str(script), timeout, output=out, stderr=err)
    return subprocess.CompletedProcess([str(script)], status, out, err), wall


@pytest.mark.parametrize("forked", [False, True], ids=["fresh", "forked"])
def test_an_empty_first_stage_fails_the_block(forked, zygote, tmp_path):
    if forked and zygote is None:
        pytest.skip("blocks are forked on Linux only")
    ok, _ = run_block("print('fine')\n", tmp_path, zygote if forked else None)
    assert ok.returncode == 0 and ok.stdout == "fine\n"
    code = "import warnings\nfrom pyterrier_prob.validation import EmptyRetrievalWarning\n"
    code += "warnings.warn(EmptyRetrievalWarning('20 of 20 queries retrieved nothing'))\n"
    failed, _ = run_block(code, tmp_path, zygote if forked else None)
    assert failed.returncode != 0 and "20 of 20 queries retrieved nothing" in failed.stderr


LEAK = "import sys\nshared = 1\nsys.modules['leaked_module'] = sys\nopen('left_behind.txt', 'w').close()\n"
PROBE = """import os, sys
print('shared' in globals(), 'leaked_module' in sys.modules, os.path.exists('left_behind.txt'), __name__)
print(os.getcwd() == os.path.dirname(os.path.abspath(__file__)), sys.argv[0] == __file__)
sys.stderr.write('to stderr')
sys.exit(3)
"""


def test_a_forked_block_starts_clean_with_its_own_folder_status_and_output(zygote, tmp_path):
    if zygote is None:
        pytest.skip("blocks are forked on Linux only")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, _ = run_block(LEAK, tmp_path / "a", zygote)
    assert first.returncode == 0 and (tmp_path / "a" / "left_behind.txt").exists()
    probe, _ = run_block(PROBE, tmp_path / "b", zygote)
    assert probe.returncode == 3 and probe.stdout.split() == ["False", "False", "False", "__main__", "True", "True"]
    assert probe.stderr == "to stderr"
    raised, _ = run_block("raise KeyError('no such column')\n", tmp_path / "b", zygote)
    assert raised.returncode == 1 and "KeyError: 'no such column'" in raised.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        run_block("import time\ntime.sleep(30)\n", tmp_path / "b", zygote, timeout=1)
    again, _ = run_block("print('after the timeout')\n", tmp_path / "b", zygote)  # the zygote serves on
    assert again.returncode == 0 and again.stdout == "after the timeout\n"


@pytest.mark.slow
@pytest.mark.parametrize("code", [p.values[0] for p in BLOCKS], ids=[p.id for p in BLOCKS])
def test_block_runs_as_copied(code, zygote, tmp_path):
    try:
        proc, wall = run_block(code, tmp_path, zygote)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the block ran past {TIMEOUT_S} s; its stderr:\n{(e.stderr or b'')[-4000:]!r}")
    print(f"wall time {wall:.1f} s")
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} after {wall:.1f} s\n--- stdout ---\n{proc.stdout[-3000:]}"
        f"\n--- stderr ---\n{proc.stderr[-6000:]}"
    )
