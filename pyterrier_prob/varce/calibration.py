"""How far a re-ranker's scores are probabilities: a Platt map fitted on dev pairs (:func:`fit_platt`; for a
VarCrossEncoder the Gaussian score integrated out by the probit approximation, MacKay 1992), the expected calibration
error over equal-mass bins and the reliability curve (Guo et al., ICML 2017)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import optimize

__all__ = ["expected_calibration_error", "fit_platt", "relevance_labels", "relevance_probability", "reliability_curve"]


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
