"""Lines of package code (``pyterrier_prob/`` + ``st_extensions/``, as ``wc -l`` counts them) now and at a base
revision, and how many of today's lines implement features the base did not have.

"The same features in fewer lines" compares like with like: the modules in :data:`ADDED` were written for features
added after the base (each with the commit that created it). The script checks that each was absent at the base and
counts its lines; any top-level function or class in them whose name is also defined at the base (anywhere in the
package) is counted back as old code, since it may have moved there. What remains is subtracted from today's count.

    python benchmarks/package_lines.py --base eb14f3c     # writes benchmarks/results/package_lines.json
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

from st_extensions.atomic import atomic_write

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pyterrier_prob", "st_extensions")
ADDED = {
    "st_extensions/cross_encoder/split.py": ("3deaec6", "split-attention (PreTTR) cross-encoder students"),
    "pyterrier_prob/varce/distill.py": ("3deaec6", "distillation pools, teacher scores and rows"),
    "pyterrier_prob/experiments/varce_distill.py": ("3deaec6", "pyterrier-prob varce --teacher"),
    "pyterrier_prob/varce/calibration.py": ("3deaec6", "the re-rankers' calibration: Platt map, reliability, ECE"),
    "st_extensions/model_card.py": ("d38ed7a", "model cards on every saved model"),
    "st_extensions/threads.py": ("d38ed7a", "thread counts from the usable CPUs; batch scheduling"),
    "pyterrier_prob/varce/pseudo_queries.py": ("8c1cf96", "pseudo-queries cut from the training documents"),
    "pyterrier_prob/varce/selective.py": ("5bddee9", "selective prediction: risk-coverage, AURC, NQC, WIG, MC dropout"),
    "pyterrier_prob/rerank_depth.py": ("c0dfad9", "per-query re-ranking depth: DepthRerank and its rules"),
    "pyterrier_prob/experiments/depth.py": ("74d8d18", "pyterrier-prob depth"),
    "pyterrier_prob/index/backends/hnsw_sq.py": ("55996e9", "the hnsw_sq8 search backend"),
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def sources(rev: str | None) -> dict[str, str]:
    """Every ``.py`` file of the packages at ``rev`` (None: the working tree) -> its text."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    names = git("ls-tree", "-r", "--name-only", rev, "--", *PACKAGES).split()
    return {n: git("show", f"{rev}:{n}") for n in names if n.endswith(".py")}


def lines(text: str) -> int:
    return text.count("\n")


def defined_names(text: str) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="eb14f3c", help="the revision compared with (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/package_lines.json"), help="the JSON written")
    a = ap.parse_args()
    base, now = sources(a.base), sources(None)
    old_names = set().union(*(defined_names(t) for t in base.values()))
    added = {}
    for path, (commit, feature) in ADDED.items():
        if path in base:
            raise SystemExit(f"{path} exists at {a.base}: it is not a module added since")
        tree = ast.parse(now[path])
        moved = {n.name: n.end_lineno - n.lineno + 1 for n in tree.body if getattr(n, "name", None) in old_names}
        total = lines(now[path])
        added[path] = {"commit": commit, "feature": feature, "lines": total, "counted_back": moved}
        added[path]["new_lines"] = total - sum(moved.values())
    base_lines, now_lines = sum(map(lines, base.values())), sum(map(lines, now.values()))
    same = now_lines - sum(v["new_lines"] for v in added.values())
    result = {
        "command": f"python benchmarks/package_lines.py --base {a.base}",
        "base": git("rev-parse", "--short", a.base).strip(),
        "head": git("rev-parse", "--short", "HEAD").strip(),
        "base_lines": base_lines,
        "now_lines": now_lines,
        "added_modules": added,
        "now_lines_of_base_features": same,
        "reduction_all": round(1 - now_lines / base_lines, 4),
        "reduction_same_features": round(1 - same / base_lines, 4),
    }
    atomic_write(a.out, json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "added_modules"}, indent=1))


if __name__ == "__main__":
    main()
