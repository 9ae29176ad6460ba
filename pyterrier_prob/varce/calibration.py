"""How far a re-ranker's scores are probabilities: a Platt map fitted on dev pairs (:func:`fit_platt`; for a
VarCrossEncoder the Gaussian score integrated out by the probit approximation, MacKay 1992), the expected calibration
error over equal-mass bins and the reliability curve (Guo et al., ICML 2017); and how far its *orderings* are: the
ranking calibration error of :func:`ranking_calibration` (the probability that the higher-scored of two documents of
a query is the more relevant, Bradley-Terry, against how often it is)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import optimize

__all__ = [
    "expected_calibration_error",
    "fit_platt",
    "fit_preference",
    "preference_pairs",
    "preference_probability",
    "ranking_calibration",
    "relevance_labels",
    "relevance_probability",
    "reliability_curve",
]


def relevance_labels(pairs: pd.DataFrame, qrels: pd.DataFrame) -> np.ndarray:
    """1 for each (qid, docno) row of ``pairs`` judged relevant (label > 0) in ``qrels``, else 0 (unjudged too)."""
    rel = qrels[qrels["label"] > 0][["qid", "docno"]].assign(rel=1)
    return pairs[["qid", "docno"]].merge(rel, how="left", on=["qid", "docno"])["rel"].fillna(0).to_numpy()


def relevance_probability(score: np.ndarray, platt: tuple[float, float], std: np.ndarray | None = None) -> np.ndarray:
    """P(relevant) of each pair: ``sigmoid(a s + b)``, or with ``std`` (a Gaussian score) the probit approximation
    of its expectation over ``s ~ N(score, std^2)``."""
    a, b = platt
    logit = a * np.asarray(score, np.float64) + b
    if std is not None:
        logit = logit / np.sqrt(1.0 + math.pi * (a * np.asarray(std, np.float64)) ** 2 / 8.0)
    return 1.0 / (1.0 + np.exp(-logit))


def fit_platt(score: np.ndarray, label: np.ndarray, std: np.ndarray | None = None) -> tuple[float, float]:
    """``(a, b)`` maximising the Bernoulli likelihood of ``label`` (1 relevant, 0 not) under
    :func:`relevance_probability` (with ``std``: the Gaussian score integrated out, as it will be applied)."""
    y = np.asarray(label, np.float64)
    if y.min() == y.max():
        raise ValueError("fit_platt needs relevant and non-relevant pairs (the labels are all equal)")

    def nll(theta: np.ndarray) -> float:
        p = np.clip(relevance_probability(score, (theta[0], theta[1]), std), 1e-12, 1 - 1e-12)
        return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))

    s = np.asarray(score, np.float64)
    start = np.array([1.0 / max(float(s.std()), 1e-6), -float(s.mean()) / max(float(s.std()), 1e-6)])
    res = optimize.minimize(nll, start, method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9, "maxiter": 4000})
    return float(res.x[0]), float(res.x[1])


def reliability_curve(prob: np.ndarray, label: np.ndarray, bins: int = 15) -> pd.DataFrame:
    """Equal-mass bins of the predicted probability: ``count, mean_prob, frac_relevant`` per bin."""
    p, y = np.asarray(prob, np.float64), np.asarray(label, np.float64)
    if len(p) != len(y) or len(p) == 0:
        raise ValueError(f"prob and label must be non-empty and of one length, got {len(p)} and {len(y)}")
    parts = np.array_split(np.argsort(p, kind="stable"), min(bins, len(p)))
    rows = [(len(i), float(p[i].mean()), float(y[i].mean())) for i in parts]
    return pd.DataFrame(rows, columns=["count", "mean_prob", "frac_relevant"])


def expected_calibration_error(prob: np.ndarray, label: np.ndarray, bins: int = 15) -> float:
    """ECE over equal-mass bins: sum_b (n_b / n) |mean prob_b - fraction relevant_b| (Guo et al., 2017)."""
    curve = reliability_curve(prob, label, bins)
    return float((curve["count"] / curve["count"].sum() * (curve["mean_prob"] - curve["frac_relevant"]).abs()).sum())


def preference_pairs(
    frame: pd.DataFrame, qrels: pd.DataFrame, score: str, std: str | None = None, depth: int = 10
) -> pd.DataFrame:
    """Per query of a re-ranked ``frame`` (``qid, docno`` and the ``score`` column), every two of its top ``depth``
    documents by ``score`` whose judged labels differ (unjudged: 0), the higher-scored first: ``delta`` (the score
    difference, >= 0), ``var`` (the two scores' variances summed, from the ``std`` column; 0 without it) and ``agree``
    (1 when the higher-scored document is the more relevant)."""
    labels = frame[["qid", "docno"]].merge(qrels[["qid", "docno", "label"]], how="left", on=["qid", "docno"])
    f = pd.DataFrame({"qid": frame["qid"].to_numpy(), "s": frame[score].to_numpy(np.float64)})
    f["v"] = frame[std].to_numpy(np.float64) ** 2 if std is not None else 0.0
    f["y"] = labels["label"].fillna(0).to_numpy(np.float64)
    top = f.sort_values(["qid", "s"], ascending=[True, False], kind="stable").groupby("qid", sort=False).head(depth)
    parts = []
    for _, g in top.groupby("qid", sort=False):
        s, v, y = g["s"].to_numpy(), g["v"].to_numpy(), g["y"].to_numpy()
        i, j = np.triu_indices(len(g), 1)  # i ranked above j
        keep = y[i] != y[j]
        i, j = i[keep], j[keep]
        parts.append(pd.DataFrame({"delta": s[i] - s[j], "var": v[i] + v[j], "agree": (y[i] > y[j]).astype(float)}))
    columns = {"delta": [], "var": [], "agree": []}
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns, dtype=float)


def preference_probability(delta: np.ndarray, a: float, var: np.ndarray | float = 0.0) -> np.ndarray:
    """P(the higher-scored document is the more relevant) = ``sigmoid(a * delta)`` (Bradley-Terry on the score
    difference), with ``var`` (a Gaussian score difference) the probit approximation of its expectation,
    ``sigmoid(a * delta / sqrt(1 + pi * a^2 * var / 8))``, as :func:`relevance_probability` integrates one score."""
    z = a * np.asarray(delta, np.float64) / np.sqrt(1.0 + math.pi * a * a * np.asarray(var, np.float64) / 8.0)
    return 1.0 / (1.0 + np.exp(-z))


def fit_preference(delta: np.ndarray, agree: np.ndarray, var: np.ndarray | float = 0.0) -> float:
    """The ``a >= 0`` maximising the Bernoulli likelihood of ``agree`` under :func:`preference_probability`."""
    y = np.asarray(agree, np.float64)
    if len(y) == 0:
        raise ValueError("fit_preference needs at least one pair of documents with different labels")

    def nll(log_a: float) -> float:
        p = np.clip(preference_probability(delta, math.exp(log_a), var), 1e-12, 1 - 1e-12)
        return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))

    scale = max(float(np.std(delta)), 1e-6)
    res = optimize.minimize_scalar(nll, bounds=(math.log(1e-4 / scale), math.log(1e4 / scale)), method="bounded")
    return float(math.exp(res.x))


def ranking_calibration(dev: pd.DataFrame, test: pd.DataFrame, bins: int = 15) -> dict[str, float]:
    """The ranking calibration error of a re-ranker: ``a`` fitted on the ``dev`` :func:`preference_pairs`, the ECE of
    :func:`preference_probability` against ``agree`` on the ``test`` pairs (``rce``), and, where the pairs carry score
    variances, the same without them (``rce_without_std``: what integrating the uncertainty out changes)."""
    a = fit_preference(dev["delta"], dev["agree"], dev["var"])
    prob = preference_probability(test["delta"], a, test["var"])
    out = {"a": a, "pairs": int(len(test)), "agree": float(test["agree"].mean())}
    out["rce"] = expected_calibration_error(prob, test["agree"].to_numpy(), bins)
    if float(np.max(dev["var"].to_numpy(), initial=0.0)) > 0:
        a0 = fit_preference(dev["delta"], dev["agree"])
        out["rce_without_std"] = expected_calibration_error(
            preference_probability(test["delta"], a0), test["agree"].to_numpy(), bins
        )
    return out
