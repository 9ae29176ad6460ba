"""Query-level selective prediction: is a re-ranker's confidence in a query worth anything? Queries are answered in
decreasing confidence; the risk-coverage curve gives the mean risk (here 1 - nDCG@10) of the answered share, and its
area (AURC) and excess over the best order (E-AURC) score the confidence (Geifman, Uziel, El-Yaniv, ICLR 2019, Sec. 3;
applied to rankers by Cohen et al., SIGIR 2021, and Penha & Hauff, EACL 2021). Confidences: the VarCE's std[s] over
its top 10 (Eq. 23), the score alone, query-performance predictors on the first stage's scores (NQC, Shtok et al., TOIS
2012; WIG, Zhou & Croft, SIGIR 2007) and MC dropout (Gal & Ghahramani, ICML 2016). Plain frames in and out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from pyterrier_prob.varce.distill import score_pairs

__all__ = [
    "aurc",
    "e_aurc",
    "mc_dropout_std",
    "nqc",
    "risk_coverage",
    "selective_table",
    "top_k_mean",
    "wig",
]


def _aligned(risk: pd.Series | Sequence[float], confidence: pd.Series | Sequence[float]) -> tuple:
    if isinstance(risk, pd.Series) and isinstance(confidence, pd.Series):
        risk, confidence = risk.align(confidence, join="inner")
    r, c = np.asarray(risk, dtype=np.float64), np.asarray(confidence, dtype=np.float64)
    if r.shape != c.shape or r.ndim != 1 or not len(r):
        raise ValueError(
            f"risk and confidence must be two non-empty series of one value per query, got {r.shape}, {c.shape}"
        )
    if not (np.isfinite(r).all() and np.isfinite(c).all()):
        raise ValueError("risk and confidence must be finite (a query without a confidence: leave it out)")
    return r, c


def risk_coverage(risk: pd.Series | Sequence[float], confidence: pd.Series | Sequence[float]) -> pd.DataFrame:
    """``coverage, risk``: for k = 1..n, the mean risk of the k most confident queries (the selective risk at coverage
    k/n). Queries of equal confidence count in any order with equal chance: within a tie, each takes the tie's mean
    risk (so the curve does not depend on the input order). ``risk``/``confidence`` aligned on their index when both
    are Series."""
    r, c = _aligned(risk, confidence)
    order = np.argsort(-c, kind="stable")
    r, c = r[order], c[order]
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    sizes = np.diff(np.r_[starts, len(c)])
    tied = np.repeat(np.add.reduceat(r, starts) / sizes, sizes)  # each query's tie mean
    k = np.arange(1, len(r) + 1)
    return pd.DataFrame({"coverage": k / len(r), "risk": np.cumsum(tied) / k})


def aurc(risk: pd.Series | Sequence[float], confidence: pd.Series | Sequence[float]) -> float:
    """Area under the risk-coverage curve: the mean selective risk over coverages 1/n..1 (Geifman et al. 2019, Eq. 3).
    A useless confidence gives about the mean risk; lower is better."""
    return float(risk_coverage(risk, confidence)["risk"].mean())


def e_aurc(risk: pd.Series | Sequence[float], confidence: pd.Series | Sequence[float]) -> float:
    """AURC minus that of the best possible confidence (``-risk``: the queries in increasing risk), Eq. 4."""
    r, c = _aligned(risk, confidence)
    return aurc(r, c) - aurc(r, -r)


def top_k_mean(run: pd.DataFrame, column: str, score: str = "score", k: int = 10) -> pd.Series:
    """Per query (``qid``), the mean of ``column`` over its ``k`` rows of highest ``score``."""
    top = run.sort_values(["qid", score], ascending=[True, False], kind="stable").groupby("qid").head(k)
    return top.groupby("qid")[column].mean()


def nqc(run: pd.DataFrame, k: int = 100, score: str = "score") -> pd.Series:
    """Normalised query commitment (Shtok et al. 2012): the standard deviation of a query's top ``k`` first-stage
    scores over the magnitude of the corpus score, here the mean score of the query's candidates (PISA's BM25 gives
    no corpus score); higher: more confident."""
    ranked = run.sort_values(["qid", score], ascending=[True, False], kind="stable")
    spread = ranked.groupby("qid").head(k).groupby("qid")[score].std(ddof=0)
    return spread / ranked.groupby("qid")[score].mean().abs().clip(lower=1e-12)


def wig(run: pd.DataFrame, queries: Mapping[str, str], k: int = 10, score: str = "score") -> pd.Series:
    """Weighted information gain (Zhou & Croft 2007): the mean of a query's top ``k`` first-stage scores minus the
    corpus score (here: the mean over its candidates), over the square root of its length in words; higher: more
    confident."""
    ranked = run.sort_values(["qid", score], ascending=[True, False], kind="stable")
    gain = ranked.groupby("qid").head(k).groupby("qid")[score].mean() - ranked.groupby("qid")[score].mean()
    length = pd.Series({q: max(len(str(queries[q]).split()), 1) for q in gain.index}, dtype=np.float64)
    return gain / np.sqrt(length)


def mc_dropout_std(
    model: Any, queries: Sequence[str], documents: Sequence[str], passes: int = 8, seed: int = 0, batch_size: int = 64
) -> np.ndarray:
    """Per pair, the standard deviation of the score over ``passes`` forward passes with the model's dropout layers
    active (and every other module as in inference: a VarCE still reports E[s]); the model is left as it was."""
    if passes < 2:
        raise ValueError(f"MC dropout needs at least 2 passes, got {passes}")
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if not dropouts:
        raise ValueError("the model has no dropout layer with p > 0: MC dropout would report 0 for every pair")
    states, plain_eval = [m.training for m in model.modules()], model.eval

    def eval_keeping_dropout() -> Any:  # sentence-transformers' inference calls model.eval() before scoring
        plain_eval()
        for m in dropouts:
            m.train()
        return model

    scores = []
    model.eval = eval_keeping_dropout
    try:
        for i in range(passes):
            torch.manual_seed(seed + i)
            scores.append(score_pairs(model, queries, documents, batch_size)[0])
    finally:
        del model.eval
        for m, state in zip(model.modules(), states):
            m.train(state)
    return np.stack(scores).std(axis=0)


def selective_table(risk: pd.Series, confidences: Mapping[str, pd.Series]) -> dict[str, Any]:
    """AURC and E-AURC of each confidence (qid-indexed, higher: more confident) for per-query ``risk``, over the
    queries every confidence covers, with the references: ``random`` (the mean risk: what a useless order gives on
    average) and ``optimal`` (the queries in increasing risk); ``curves``: each confidence's risk-coverage curve."""
    common = risk.index
    for c in confidences.values():
        common = common.intersection(c.dropna().index)
    r = risk.reindex(common)
    out: dict[str, Any] = {"queries": int(len(r)), "random": float(r.mean()), "optimal": aurc(r, -r)}
    out["aurc"] = {n: aurc(r, c.reindex(common)) for n, c in confidences.items()}
    out["e_aurc"] = {n: v - out["optimal"] for n, v in out["aurc"].items()}
    out["curves"] = {n: risk_coverage(r, c.reindex(common)).to_dict("list") for n, c in confidences.items()}
    return out
