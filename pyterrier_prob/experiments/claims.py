"""The claims file (``benchmarks/results/claims.json``): one row per (paper, claim, recipe, system, metric) with the
system's and the baseline's means on the same test queries and the paired t-test's p (``scipy.stats.ttest_rel``);
each experiment's report stage adds or replaces its rows with :func:`record_claims` (``--claims-json PATH``)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.evaluation import paired_p
from st_extensions.atomic import locked

__all__ = ["KEY", "paired_claim", "perquery_claims", "record_claims", "write_claims"]

#: the fields that name a row: a new row replaces the old one with the same values of these
KEY = ("paper", "claim", "recipe", "system", "metric")


def _num(x: Any) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def paired_claim(
    paper: str,
    claim: str,
    system: str,
    baseline: str,
    metric: str,
    values: Mapping[str, float] | pd.Series,
    baseline_values: Mapping[str, float] | pd.Series,
) -> dict[str, Any]:
    """A claim row's figures from per-query values (qid -> value) of ``system`` and ``baseline``: the means over the
    queries both have and the paired t-test's p on them (None when undefined: fewer than 2 queries, or equal values)."""
    v, b = (pd.Series(x, dtype=float).rename(index=str) for x in (values, baseline_values))
    v, b = v.align(b, join="inner")
    if v.empty:
        raise ValueError(f"claim {claim!r}: {system!r} and {baseline!r} have no query in common")
    row = {"paper": paper, "claim": claim, "system": system, "baseline": baseline, "metric": metric}
    row |= {"value": float(v.mean()), "baseline_value": float(b.mean()), "p": paired_p(v, b)}
    return {**row, "queries": len(v)}


def perquery_claims(
    h: Any,
    runs: Mapping[str, pd.DataFrame],
    data: Any,
    paper: str,
    claim: str,
    system: str,
    baseline: str,
    metrics: Sequence[str],
) -> list[dict[str, Any]]:
    """:func:`paired_claim` rows, one per metric, of the ``system`` and ``baseline`` runs on every test query."""
    pair = {system: runs[system], baseline: runs[baseline]}
    frame = h.experiment(pair, data.test_topics, data.test_qrels, metrics, perquery=True)
    qids = data.test_topics["qid"].astype(str)
    rows = []
    for metric in metrics:
        per = frame[frame["measure"].astype(str) == str(metric)].assign(qid=lambda f: f["qid"].astype(str))
        values = {n: per[per["name"] == n].set_index("qid")["value"].reindex(qids, fill_value=0.0) for n in runs}
        rows.append(paired_claim(paper, claim, system, baseline, str(metric), values[system], values[baseline]))
    return rows


def write_claims(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> str:
    """Add ``rows`` to the claims file ``path`` (``{"rows": [...]}``), replacing those with the same :data:`KEY`;
    under a lock (``.<name>.lock`` beside it) and written atomically. Returns the path."""
    path = os.fspath(path)
    new = {tuple(r[k] for k in KEY): {**r, "p": _num(r.get("p"))} for r in rows}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with locked(os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.lock")):
        try:
            with open(path, encoding="utf8") as f:
                old = json.load(f)["rows"]
        except FileNotFoundError:
            old = []
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--claims-json {path!r} is not a claims file ({{'rows': [...]}}): {e}") from e
        kept = [r for r in old if tuple(r.get(k) for k in KEY) not in new]
        merged = sorted([*kept, *new.values()], key=lambda r: tuple(str(r.get(k)) for k in KEY))
        return atomic_write(path, json.dumps({"rows": merged}, indent=1))


def record_claims(cfg: Any, rows: Iterable[Mapping[str, Any]]) -> str | None:
    """With ``--claims-json``: add ``rows`` with the run's ``recipe``, ``device`` and ``command`` to that file."""
    path = getattr(cfg, "claims_json", None)
    if not path:
        return None
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    run = {"recipe": cfg.recipe, "device": device, "command": getattr(cfg, "command", None)}
    return write_claims(path, [{**r, **run} for r in rows])
