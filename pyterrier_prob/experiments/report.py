"""The pieces of an experiment's report: table cells and Markdown tables, the report's head (splits, notes, recipes),
which models kept their untrained weights, a model's rows for its card."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # only the report head needs them: the table helpers stay cheap to import (benchmarks' --table)
    from pyterrier_prob.experiments.splits import Data

__all__ = [
    "cell",
    "insert_columns",
    "json_default",
    "kept_untrained",
    "loss_ends",
    "markdown_table",
    "measure_cell",
    "model_figures",
    "p_mark",
    "print_json_table",
    "report_head",
    "slug",
]


def slug(text: str, sep: str = "-") -> str:
    """``text`` (an ``irds:`` prefix dropped) with each run of other characters than ASCII letters and digits as
    ``sep``: a file or stage name."""
    return re.sub(r"[^A-Za-z0-9]+", sep, text.removeprefix("irds:")).strip(sep) or "collection"


def p_mark(p: float | None) -> str:
    """`` *`` for p < 0.05 (a paired test against the table's baseline), else ``""``."""
    return " *" if p is not None and np.isfinite(p) and p < 0.05 else ""


MISSING = "—"
"""What every report's table prints where a value is missing."""


def cell(value: Any, fmt: str) -> str:
    """A table's cell: ``value`` formatted with ``fmt``, :data:`MISSING` where it is missing (None, NaN or ±inf)."""
    missing = value is None or pd.isna(value) or (isinstance(value, float) and not math.isfinite(value))
    return MISSING if missing else format(value, fmt)


def print_json_table(path: str, render: Callable[[dict[str, Any]], Sequence[str]]) -> None:
    """Print the lines ``render`` makes of the results file at ``path`` (a benchmark's ``--table JSON``: no
    measurement)."""
    with open(path, encoding="utf8") as f:
        print("\n".join(render(json.load(f))))


def measure_cell(row: Mapping[str, Any], measure: str, fmt: str = ".4f") -> str:
    """A result table's cell: ``row[measure]`` with ``fmt``, marked `` *`` when its ``<measure> p-value`` < 0.05."""
    return f"{row[measure]:{fmt}}{p_mark(row.get(f'{measure} p-value', np.nan))}"


def insert_columns(frame: pd.DataFrame, at: int = 0, **columns: Any) -> pd.DataFrame:
    """``frame`` with ``columns`` inserted in their order from position ``at`` (in place)."""
    for i, (name, values) in enumerate(columns.items()):
        frame.insert(at + i, name, values)
    return frame


def loss_ends(losses: Sequence[float], n: int = 10) -> tuple[float, float] | None:
    """Means of the first and last ``n`` logged training losses (None for none), for reports."""
    return (float(np.mean(losses[:n])), float(np.mean(losses[-n:]))) if len(losses) else None


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """A frame as a GitHub Markdown table (floats with ``floatfmt``, NaN as blank)."""

    def cell(v: Any) -> str:
        if isinstance(v, (float, np.floating)):
            return "" if not np.isfinite(v) else format(float(v), floatfmt)
        return str(v)

    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def kept_untrained(curves: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The models whose learning curve (a :func:`curve_summaries` entry or a saved curve) has points after step 0
    but its best at step 0: the weights kept are the untrained start."""
    out = []
    for name, c in curves.items():
        best = c["best_step"] if "best_step" in c else (c.get("best") or {}).get("step")
        if best == 0 and c.get("evaluations", len(c.get("points") or [])) > 1:
            out.append(name)
    return out


def model_figures(name: str, tables: Mapping[str, pd.DataFrame]) -> str:
    """The rows of ``tables`` whose first text column names the model ``name`` as Markdown (none: the first table)."""
    parts = []
    for title, frame in tables.items():
        text = [c for c in frame.columns if pd.api.types.is_string_dtype(frame[c])]
        rows = frame[frame[text[0]].astype(str).str.lower().str.contains(name.lower(), regex=False)] if text else None
        if rows is not None and len(rows):
            parts.append(f"`{title}`:\n\n{markdown_table(rows)}")
    if not parts and tables:
        title, frame = next(iter(tables.items()))
        parts.append(f"`{title}` (all systems of the run):\n\n{markdown_table(frame)}")
    return "\n\n".join(parts) or "none"


def json_default(o: Any) -> Any:
    return o.tolist() if isinstance(o, (np.integer, np.floating, np.ndarray)) else str(o)


def report_head(title: str, data: Data | None, recipes: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The report's first lines: the splits used (with their notes) and the recipe each model trained under
    (``recipes``: model name -> :meth:`Recipe.to_dict`)."""
    head = [f"# {title}", ""]
    if data is not None:
        d = data.describe()
        head.append(
            f"Trained on {d['train'] or 'nothing (no fine-tuning)'}; calibration/dev: {d['calibration']}; "
            f"test: {d['test']} ({d['n_test_queries']} queries)."
        )
        if d["notes"]:
            head += ["", *[f"- {n}" for n in d["notes"]]]
        head.append("")
    from pyterrier_prob.training import Recipe  # torch and transformers: imported only where a report is written

    by_recipe: dict[str, list[str]] = {}
    for name, values in recipes.items():
        by_recipe.setdefault(Recipe.from_dict(values).describe(), []).append(name)
    for described, names in by_recipe.items():
        head += [f"Recipe of {', '.join(names)}: {described}", ""]
    return head
