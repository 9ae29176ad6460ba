"""Score interpolation of a re-ranker with its first stage: ``alpha * z(re-ranker) + (1 - alpha) * z(first stage)``.

Each score is standardised within its query (z-scores), so that ``alpha`` means the same for every query and model
(1: the re-ranker alone, 0: the first stage's order); choose it on dev queries (:func:`choose_alpha`)::

    pipeline = bm25 % 100 >> text_loader >> ScoreInterpolation(reranker, alpha=0.3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.validation import probability, require_columns

__all__ = ["ALPHAS", "ScoreInterpolation", "choose_alpha", "interpolate", "zscore_per_query"]

QidsLike = Sequence[Any] | pd.Series
ScoresLike = Sequence[float] | np.ndarray


def zscore_per_query(qids: QidsLike, scores: ScoresLike) -> np.ndarray:
    """``scores`` standardised within each query (population sd; 0 for a query of constant scores); ValueError on
    a non-finite score."""
    s = np.asarray(scores, dtype=np.float64)
    q = pd.Series(np.asarray(qids, dtype=object))
    if len(q) != len(s):
        raise ValueError(f"qids and scores differ in length: {len(q)} != {len(s)}")
    if len(bad := np.flatnonzero(~np.isfinite(s))):
        raise ValueError(f"score of row {int(bad[0])} (qid {q.iloc[bad[0]]!r}) is {s[bad[0]]}: scores must be finite")
    g = pd.Series(s).groupby(q.to_numpy())
    sd = g.transform("std", ddof=0).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sd > 0, (s - g.transform("mean").to_numpy()) / sd, 0.0)


def interpolate(qids: QidsLike, first: ScoresLike, second: ScoresLike, alpha: float) -> np.ndarray:
    """``alpha * z(second) + (1 - alpha) * z(first)``, each standardised within its query (:func:`zscore_per_query`);
    ``first`` is the first stage's score, ``second`` the re-ranker's."""
    alpha = probability("alpha", alpha)
    return alpha * zscore_per_query(qids, second) + (1.0 - alpha) * zscore_per_query(qids, first)


class ScoreInterpolation(pt.Transformer):
    """Runs ``reranker`` (which must score every candidate) on a first stage's ``qid, docno, score`` and ranks by
    ``alpha * z(reranker's score) + (1 - alpha) * z(incoming score)`` (z within each query).

    Output: the reranker's rows with ``first_score``, ``reranker_score``, ``score`` (the interpolation) and ``rank``
    (from 0), each query's best first (ties keep the reranker's order).
    """

    def __init__(self, reranker: pt.Transformer, alpha: float) -> None:
        if not isinstance(reranker, pt.Transformer):
            raise TypeError(f"reranker must be a pyterrier Transformer, got {type(reranker).__name__}")
        self.reranker = reranker
        self.alpha = probability("alpha", alpha)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        require_columns(inp, ("qid", "docno", "score"), "ScoreInterpolation's input (the first stage's results)")
        if inp.empty:
            return inp.assign(first_score=[], reranker_score=[], rank=[])
        if inp.duplicated(["qid", "docno"]).any():
            row = inp.index[inp.duplicated(["qid", "docno"])][0]
            raise ValueError(f"row {row}: (qid, docno) {tuple(inp.loc[row, ['qid', 'docno']])} occurs twice")
        first = inp[["qid", "docno", "score"]].rename(columns={"score": "first_score"})
        out = self.reranker(inp.drop(columns=["rank"], errors="ignore"))
        out = out.drop(columns=["first_score"], errors="ignore").merge(first, on=["qid", "docno"], how="left")
        if len(out) != len(inp) or out["first_score"].isna().any():
            raise ValueError(
                f"the reranker returned {len(out)} rows for {len(inp)} candidates (or documents it was not given): "
                "ScoreInterpolation needs a re-ranker that scores every candidate"
            )
        out = out.rename(columns={"score": "reranker_score"})
        out = out.assign(score=interpolate(out["qid"], out["first_score"], out["reranker_score"], self.alpha))
        out = out.sort_values(["qid", "score"], ascending=[True, False], kind="stable").reset_index(drop=True)
        return out.assign(rank=out.groupby("qid").cumcount())

    def __repr__(self) -> str:
        return f"ScoreInterpolation({self.reranker!r}, alpha={self.alpha:g})"


ALPHAS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""The alphas :func:`choose_alpha` tries by default."""


def choose_alpha(
    evaluate: Callable[[float], float], alphas: Sequence[float] = ALPHAS
) -> tuple[float, dict[float, float]]:
    """The ``alpha`` with the highest ``evaluate(alpha)`` (e.g. dev nDCG@10 of the interpolated run; ties: the
    smaller alpha) and every value tried."""
    if not alphas:
        raise ValueError("alphas is empty")
    values = {probability("alpha", a): float(evaluate(float(a))) for a in alphas}
    return max(values, key=lambda a: (values[a], -a)), values
