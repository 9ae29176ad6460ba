"""Analyses of re-ranked runs (VarCrossEncoder Sec. 5; docs/varce.md): ranking by E[s] (Eq. 22) or the risk-aware
E[s] - lambda * std[s], the blend with BM25, nDCG@10 rows with paired t-tests, whether std[s] (Eq. 23) is
informative, and the choices made on dev queries. Plain frames in and out, for the command line and notebooks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ir_measures
import numpy as np
import pandas as pd
import pyterrier as pt
from scipy.stats import spearmanr

from pyterrier_prob.evaluation import paired_p
from pyterrier_prob.fusion import interpolate
from pyterrier_prob.varce.distill import ndcg_at_10, score_pairs
from pyterrier_prob.varce.hard_queries import per_query
from pyterrier_prob.varce.rerank import risk_adjusted

__all__ = [
    "DevRerank",
    "choose_risk",
    "interpolated",
    "ranked",
    "rerank_rows",
    "risk_table",
    "system_rows",
    "top10",
    "uncertainty_stats",
]


def ranked(cand: pd.DataFrame, mean: np.ndarray, std: np.ndarray, risk: float = 0.0) -> pd.DataFrame:
    """The candidates (``qid, docno, rank``) re-ranked by E[s] - risk * std[s] (risk 0: E[s], Eq. 22; ties keep the
    BM25 order). Returns ``qid, docno, score, score_mean, score_std, bm25_rank, rank`` (rank from 0)."""
    mean, std = np.asarray(mean), np.asarray(std)  # positional, whatever the index of cand
    score = np.asarray(mean, dtype=np.float64) if risk == 0 else risk_adjusted(mean, std, risk)
    out = cand[["qid", "docno"]].assign(score=score, score_mean=mean, score_std=std, bm25_rank=cand["rank"].to_numpy())
    out = out.sort_values(["qid", "score", "bm25_rank"], ascending=[True, False, True], kind="stable")
    out["rank"] = out.groupby("qid").cumcount()
    return out.reset_index(drop=True)


def interpolated(cand: pd.DataFrame, mean: np.ndarray, alpha: float) -> pd.DataFrame:
    """BM25's candidates (``qid, docno, score, rank``) ranked by ``alpha * z(E[s]) + (1 - alpha) * z(BM25 score)``
    (:func:`pyterrier_prob.fusion.interpolate`; ties keep the BM25 order)."""
    return ranked(cand, interpolate(cand["qid"], cand["score"].to_numpy(np.float64), mean, alpha), np.zeros(len(cand)))


def top10(run: pd.DataFrame) -> pd.Series:
    """Each query's top 10 docnos (a tuple per qid)."""
    return run[run["rank"] < 10].groupby("qid")["docno"].apply(tuple)


def system_rows(per: Mapping[str, pd.Series], collection: str, depth: int, baseline: str = "CE") -> list[dict]:
    """One row per system (``collection, depth, system, queries, nDCG@10, p_vs_bm25, p_vs_CE``) from its per-query
    nDCG@10, with paired t-tests against BM25 and against ``baseline``."""
    return [
        {
            "collection": collection,
            "depth": depth,
            "system": name,
            "queries": int(len(v)),
            "nDCG@10": float(v.mean()),
            "p_vs_bm25": paired_p(v, per["BM25"]) if "BM25" in per and name != "BM25" else None,
            "p_vs_CE": paired_p(v, per[baseline]) if baseline in per and name != baseline else None,
        }
        for name, v in per.items()
    ]


def rerank_rows(
    label: str,
    depth: int,
    cand: pd.DataFrame,
    runs: Mapping[str, pd.DataFrame],
    topics: pd.DataFrame,
    qrels: pd.DataFrame,
    alphas: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """:func:`system_rows` for BM25's top ``depth`` re-ranked with the scores of ``runs`` (made at a depth >= this).
    ``alphas`` (re-ranker -> alpha chosen on dev) adds the system ``<re-ranker>+BM25``: BM25's top ``depth`` ranked by
    :func:`interpolated` (z within each query over those ``depth`` candidates)."""
    top = cand[cand["rank"] < depth][["qid", "docno", "score", "rank"]]
    keep = set(zip(top["qid"], top["docno"]))
    per: dict[str, pd.Series] = {}
    for name, run in runs.items():
        if name == "BM25":
            r = top
        else:
            r = run[[k in keep for k in zip(run["qid"], run["docno"])]].drop(columns=["rank"])
            r = ranked(r.assign(rank=r["bm25_rank"]), r["score_mean"].to_numpy(), r["score_std"].to_numpy())
        per[name] = per_query(r, qrels, "nDCG@10", topics=topics)
        if name != "BM25" and alphas and name in alphas:
            both = top.merge(r[["qid", "docno", "score_mean"]], on=["qid", "docno"], validate="one_to_one")
            fused = interpolated(both, both["score_mean"].to_numpy(), alphas[name])
            per[f"{name}+BM25"] = per_query(fused, qrels, "nDCG@10", topics=topics)
    return system_rows(per, label, depth)


def choose_risk(evaluate: Callable[[float], float], risks: Sequence[float]) -> tuple[float, dict[float, float]]:
    """The lambda of E[s] - lambda * std[s] with the highest ``evaluate(lambda)`` (e.g. dev nDCG@10; ties: the
    smaller |lambda|) and every value tried (as :func:`pyterrier_prob.fusion.choose_alpha` for alpha)."""
    values = {float(r): float(evaluate(float(r))) for r in risks}
    return max(values, key=lambda r: (values[r], -abs(r))), values


def risk_table(
    run: pd.DataFrame,
    topics: pd.DataFrame,
    qrels: pd.DataFrame,
    risks: Sequence[float],
    measures: Sequence[str] = ("nDCG@10", "RR@10"),
) -> pd.DataFrame:
    """``pt.Experiment`` of a re-ranked run (:func:`ranked`'s columns) re-ranked by E[s] - lambda * std[s] for each
    lambda of ``risks`` (the first is the paired t-tests' baseline), with ``risk`` and ``changed_top10`` (the share of
    queries whose top 10 differs from the first lambda's)."""
    mean, std = run["score_mean"].to_numpy(), run["score_std"].to_numpy()
    base = run[["qid", "docno"]].assign(rank=run["bm25_rank"].to_numpy())
    runs = [ranked(base, mean, std, r) for r in risks]
    first = top10(runs[0])
    frames = [r[["qid", "docno", "score"]].assign(qid=r["qid"].astype(str)) for r in runs]
    metrics = [ir_measures.parse_measure(m) for m in measures]
    exp = pt.Experiment(frames, topics, qrels, metrics, names=[f"risk={r:g}" for r in risks], baseline=0)
    exp.insert(0, "risk", list(risks))
    exp["changed_top10"] = [float((top10(r) != first.reindex(top10(r).index)).mean()) for r in runs]
    return exp


def _rho(a: pd.Series, b: pd.Series) -> tuple[float, float]:
    if a.nunique() < 2 or b.nunique() < 2:
        return math.nan, math.nan
    r, p = spearmanr(a, b)
    return float(r), float(p)


def uncertainty_stats(run: pd.DataFrame, ndcg: pd.Series) -> dict[str, Any]:
    """Is std[s] (Eq. 23) informative? Its spread over the pairs (quantiles, between and within queries), Spearman's
    rho of each query's mean std[s] over its top 10 with its nDCG@10 (``ndcg``, qid-indexed), the same with the mean
    E[s] (Eq. 22) for reference, and the rank correlation of std[s] with E[s] over all pairs. ``run``: :func:`ranked`'s
    columns. A share or ratio with a zero denominator (std[s] constant, or 0 in a query) is NaN: undefined, not 0."""
    top = run[run["rank"] < 10]
    u, m = (top.groupby("qid")[c].mean().reindex(ndcg.index) for c in ("score_std", "score_mean"))
    ok = u.notna()
    r_std, p_std = _rho(u[ok], ndcg[ok])
    r_mean, p_mean = _rho(m[ok], ndcg[ok])
    within = run.groupby("qid")["score_std"].agg(lambda s: s.std(ddof=0) / s.mean() if s.mean() > 0 else math.nan)
    # the spread between queries, within them, and the between-query share of the variance over all pairs
    by_query = run.groupby("qid")["score_std"]
    total_var = float(run["score_std"].var(ddof=0))
    between_var = float(((by_query.transform("mean") - run["score_std"].mean()) ** 2).mean())
    return {
        "n_queries": int(ok.sum()),
        "rho_top10_std_vs_nDCG@10": r_std,
        "p_top10_std": p_std,
        "rho_top10_mean_vs_nDCG@10": r_mean,
        "p_top10_mean": p_mean,
        **{f"std_q{q:02d}": float(v) for q, v in zip((5, 50, 95), np.quantile(run["score_std"], [0.05, 0.5, 0.95]))},
        "std_within_query_cv_median": float(np.nanmedian(within)) if within.notna().any() else math.nan,
        "std_between_queries_sd": float(by_query.mean().std(ddof=0)),
        "std_within_query_sd_mean": float(by_query.std(ddof=0).mean()),
        "std_between_query_variance_share": between_var / total_var if total_var > 0 else math.nan,
        "rho_pairs_std_vs_mean": _rho(run["score_std"], run["score_mean"])[0],
    }


class DevRerank:
    """``model -> mean nDCG@10`` re-ranking fixed candidates (``qid, docno, query, text``) by E[s] (a
    :class:`~pyterrier_prob.curves.DevCurve`'s ``evaluate``); ``qids``: the evaluated ones (default: ``cand``'s)."""

    def __init__(
        self, cand: pd.DataFrame, qrels: pd.DataFrame, qids: Sequence[str] | None = None, batch_size: int = 64
    ) -> None:
        self.cand, self.qrels, self.batch_size = cand.reset_index(drop=True), qrels, int(batch_size)
        self.qids = None if qids is None else [str(q) for q in qids]

    def __call__(self, model: Any) -> float:
        mean, _ = score_pairs(model, self.cand["query"].tolist(), self.cand["text"].tolist(), self.batch_size)
        return float(ndcg_at_10(self.cand.assign(score=mean), self.qrels, qids=self.qids).mean())
