"""Hard-query analysis of VarCrossEncoder Sec. 5 (Table 8): Voorhees' %no, the percentage of queries with no relevant
document in the top 10 (:func:`percent_no`), and the bottom 50 % of queries by a baseline (Bigdeli et al.,
:func:`hard_queries`), on which systems are compared (:func:`hard_query_table`); measures by ``ir_measures``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ir_measures
import pandas as pd

from pyterrier_prob.evaluation import parse_measures, per_query_set_measures
from st_extensions.checks import choice, finite_float, positive_int

__all__ = ["hard_queries", "hard_query_table", "no_relevant_in_top", "per_query", "percent_no"]


def per_query(
    run: pd.DataFrame,
    qrels: pd.DataFrame,
    measure: Any = "nDCG@10",
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> pd.Series:
    """One ``ir_measures`` measure per evaluated query (0 where ``run`` has nothing), as a qid-indexed Series."""
    (m,) = parse_measures(measure)
    values = per_query_set_measures({"run": run}, qrels, None, [m], topics=topics, min_label=min_label)
    return values.set_index("qid")[str(m)].rename(str(m))


def no_relevant_in_top(
    run: pd.DataFrame,
    qrels: pd.DataFrame,
    k: int = 10,
    *,
    rel: int = 1,
    topics: pd.DataFrame | Iterable[str] | None = None,
) -> pd.Series:
    """Per evaluated query: True when none of its top ``k`` documents has label >= ``rel`` (qid-indexed bools)."""
    positive_int("k", k)
    p_at_k = per_query(run, qrels, ir_measures.P(rel=rel) @ k, topics=topics, min_label=rel)
    return (p_at_k == 0).rename(f"no_rel@{k}")


def percent_no(run: pd.DataFrame, qrels: pd.DataFrame, k: int = 10, **options: Any) -> float:
    """Voorhees' %no: the percentage (0-100) of evaluated queries with no relevant document in the top ``k``
    (``options``: :func:`no_relevant_in_top`'s ``rel`` and ``topics``)."""
    return float(100.0 * no_relevant_in_top(run, qrels, k, **options).mean())


def hard_queries(
    baseline: pd.DataFrame,
    qrels: pd.DataFrame,
    measure: Any = "nDCG@10",
    fraction: float = 0.5,
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> list[str]:
    """The qids of the ``fraction`` worst evaluated queries under ``baseline`` (Sec. 5: bottom 50 % by nDCG@10):
    the first ``max(1, floor(fraction * n))`` by ``measure`` ascending, ties by qid (deterministic), in that order."""
    finite_float("fraction", fraction, low=0, high=1, low_open=True)
    values = per_query(baseline, qrels, measure, topics=topics, min_label=min_label)
    ordered = values.rename("value").reset_index().sort_values(["value", "qid"], kind="stable")
    n_hard = max(1, math.floor(fraction * len(ordered) + 1e-9)) if len(ordered) else 0
    return ordered["qid"].astype(str).head(n_hard).tolist()


def hard_query_table(
    runs: Mapping[str, pd.DataFrame],
    qrels: pd.DataFrame,
    baseline: str | pd.DataFrame,
    measures: Sequence[Any] | str = ("nDCG@10",),
    fraction: float = 0.5,
    *,
    k: int = 10,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> pd.DataFrame:
    """Table 8 of the paper: per system of ``runs`` (``{name: result frame}``) ``name, n_queries, n_hard``, per measure
    ``<measure>`` and ``<measure> hard``, ``%no`` and ``%no hard`` (depth ``k``). ``baseline`` (a name in ``runs`` or a
    result frame) picks the hard queries by the first measure; ``topics``, ``min_label``: the evaluated queries."""
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty mapping of name -> result frame")
    if isinstance(baseline, str):
        baseline = runs[choice("baseline", baseline, list(runs))]
    ms = parse_measures(measures)
    hard = hard_queries(baseline, qrels, ms[0], fraction, topics=topics, min_label=min_label)
    per_q = per_query_set_measures(runs, qrels, None, ms, topics=topics, min_label=min_label)
    rows = []
    for name, run in runs.items():
        mine = per_q[per_q["name"] == name].set_index("qid")
        in_hard = mine.index.isin(hard)
        no = no_relevant_in_top(run, qrels, k, rel=min_label, topics=topics).reindex(mine.index)
        row: dict[str, Any] = {"name": name, "n_queries": len(mine), "n_hard": int(in_hard.sum())}
        for m in ms:
            row[str(m)] = float(mine[str(m)].mean())
            row[f"{m} hard"] = float(mine.loc[in_hard, str(m)].mean())
        row["%no"] = float(100.0 * no.mean())
        row["%no hard"] = float(100.0 * no[in_hard].mean())
        rows.append(row)
    return pd.DataFrame(rows)
