"""Ranked-list truncation for per-query cutoffs (issue #13): a rule at level ``lam`` keeps the rows of a ranked run
whose statistic (non-increasing down each list) is ``>= lam`` -- top-k, a global score, :func:`zscore_stat`,
:func:`mixture_stat`, pEBR's CDF cutoff :func:`law_stat`, :func:`gain_stat` --, at a matched mean depth, the oracle
depth, or a recall target met by conformal risk control (:class:`RecallTargetCutoff`). See ``docs/pebr.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
from scipy import stats

from pyterrier_prob.dense import TopKRetriever
from pyterrier_prob.pebr.calibration import pit_values
from pyterrier_prob.validation import positive_int

__all__ = [
    "RecallTargetCutoff",
    "conformal_recall_level",
    "conformal_resplits",
    "gain_stat",
    "law_stat",
    "level_for_depth",
    "list_features",
    "mean_measures",
    "mixture_stat",
    "oracle_runs",
    "ranked_lists",
    "row_relevance",
    "running_min",
    "zscore_stat",
]


def running_min(ranked: pd.DataFrame, stat: np.ndarray) -> np.ndarray:
    """The running minimum of a statistic down each query's list (rows sorted by qid, rank): any level then keeps a
    prefix (a truncation)."""
    return pd.Series(stat, index=ranked.index).groupby(ranked["qid"].to_numpy(), sort=False).cummin().to_numpy()


def zscore_stat(ranked: pd.DataFrame, top: int = 100) -> np.ndarray:
    """Per-query normalised score: (score - mean) / std over the query's own top ``top`` scores."""
    g = ranked[ranked["rank"] < top].groupby("qid")["score"]
    mu, sd = ranked["qid"].map(g.mean()), ranked["qid"].map(g.std(ddof=0))
    return ((ranked["score"] - mu) / sd.where(sd > 0, 1.0)).to_numpy()


def mixture_stat(ranked: pd.DataFrame, top: int = 100, iters: int = 100) -> np.ndarray:
    """Posterior probability of relevance under a per-query EM fit of the top ``top`` scores (Manmatha, Rath & Feng,
    SIGIR 2001): non-relevant exponential, relevant normal (kept above the exponential's mean); prefix-monotone."""
    out = np.zeros(len(ranked))
    for _, idx in ranked.groupby("qid", sort=False).indices.items():
        s = ranked["score"].to_numpy()[idx]
        x = np.maximum(s - s[:top].min(), 0.0)
        fit = x[:top]
        if len(fit) < 5 or fit.std() == 0:
            continue  # posterior 0
        head = fit[: max(2, len(fit) // 20)]
        w, mu, sd, lam = 0.05, float(head.mean()), float(head.std()) + 1e-3, 1.0 / (fit.mean() + 1e-9)
        for _ in range(iters):
            pr = w * stats.norm.pdf(fit, mu, sd)
            pn = (1 - w) * stats.expon.pdf(fit, scale=1.0 / lam)
            r = pr / np.maximum(pr + pn, 1e-300)
            w = float(np.clip(r.mean(), 1e-4, 1 - 1e-4))
            mu = max(float((r * fit).sum() / max(r.sum(), 1e-12)), 1.0 / lam)
            sd = float(np.sqrt((r * (fit - mu) ** 2).sum() / max(r.sum(), 1e-12))) + 1e-6
            lam = float((1 - r).sum() / max(((1 - r) * fit).sum(), 1e-12))
        pr = w * stats.norm.pdf(x, mu, sd)
        pn = (1 - w) * stats.expon.pdf(x, scale=1.0 / lam)
        out[idx] = pr / np.maximum(pr + pn, 1e-300)
    return running_min(ranked, out)


def law_stat(ranked: pd.DataFrame, law: Any) -> np.ndarray:
    """The CDF cutoff as a statistic ``F_q(score) - 1``: ``law.cutoff(p)`` keeps the rows with stat >= -p. ``ranked``
    holds the law's queries in its order, each query's rows together (:func:`ranked_lists`)."""
    return pit_values(law, [g.to_numpy() for _, g in ranked.groupby("qid", sort=False)["score"]]) - 1.0


def _logit_z(cos: np.ndarray) -> np.ndarray:
    z = np.clip((1.0 + np.asarray(cos, dtype=np.float64)) / 2.0, 1e-12, 1.0 - 1e-12)
    return np.log(z) - np.log1p(-z)


def list_features(ranked: pd.DataFrame, top: int = 100) -> pd.DataFrame:
    """Per-query features of a ranked list for ``CalibratedLaw``, in query order: ``logit_top1`` = logit((1 + s_1) / 2)
    of the top cosine and ``logit_mean_top`` = logit of the mean (1 + s) / 2 over the top ``top``."""
    top = positive_int("top", top)
    if len(ranked) == 0:
        return pd.DataFrame({"logit_top1": [], "logit_mean_top": []})
    first = ranked.groupby("qid", sort=False)["score"].first()
    head = ranked[ranked["rank"] < top].groupby("qid", sort=False)["score"].mean().reindex(first.index)
    return pd.DataFrame({"logit_top1": _logit_z(first), "logit_mean_top": _logit_z(head)})


def gain_stat(ranked: pd.DataFrame, law: Any, window: int = 5) -> np.ndarray:
    """Expected marginal recall per document under per-query cosine laws, prefix-monotone (:func:`running_min`):

        g_qj = (F_q(s_{j - w}) - F_q(s_{j + w})) / (j_+ - j_-),   j_- = max(j - w, 0), j_+ = min(j + w, n_q - 1)

    (0 for a one-document list): the oracle depth's greedy rule with the law in place of the qrels."""
    window = positive_int("window", window)
    cdf = law_stat(ranked, law) + 1.0
    out = np.zeros(len(ranked))
    for idx in ranked.groupby("qid", sort=False).indices.values():
        c, n = cdf[idx], len(idx)
        j = np.arange(n)
        lo, hi = np.maximum(j - window, 0), np.minimum(j + window, n - 1)
        out[idx] = np.where(hi > lo, (c[lo] - c[hi]) / np.maximum(hi - lo, 1), 0.0)
    return running_min(ranked, out)


def ranked_lists(index: Any, queries: pd.DataFrame, cap: int) -> pd.DataFrame:
    """Each query's top ``cap`` documents (``qid, docno, score, rank``; score = cosine), queries in the order of
    ``queries``, each query's rows together in rank order."""
    run = TopKRetriever(index, num_results=cap)(queries)  # queries in their order, as the retriever keeps it
    return _sorted_run(run[["qid", "docno", "score", "rank"]]).reset_index(drop=True)


def level_for_depth(stat: np.ndarray, n_queries: int, k: float) -> float:
    """The level at which the rows with stat >= level number ``k`` per query on average (the k·Q-th largest stat):
    matched mean depth (pEBR Sec. 4.1.3), exact up to ties."""
    srt = np.sort(stat)[::-1]
    return float(srt[int(np.clip(round(k * n_queries), 1, len(srt))) - 1])


def conformal_recall_level(stat: np.ndarray, qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, target: float):
    """Conformal risk control for a recall target (Angelopoulos et al., ICLR 2024, Thm. 1): the shallowest lam with

        n / (n + 1) * mean_i L_i(lam) + 1 / (n + 1) <= 1 - target,   L_i(lam) = 1 - recall_i(lam) in [0, 1],

    over the n calibration queries with a relevant document, guarantees E[recall] >= target on a new exchangeable
    query. ``n_rel`` counts all judged-relevant documents (also below the lists' cap). Returns ``(lam, achievable)``;
    ``(-inf, False)`` (keep the whole list) when even that misses the bound.
    """
    has = n_rel > 0
    n = int(has.sum())
    if n == 0:
        raise ValueError("no calibration query has a relevant document: cannot calibrate a recall target")
    need = 1.0 - ((1.0 - target) * (n + 1) - 1.0) / n  # mean recall the calibration queries must reach
    rel_rows = np.flatnonzero(is_rel & has[qidx])
    order = rel_rows[np.argsort(-stat[rel_rows], kind="stable")]
    gain = np.cumsum(1.0 / n_rel[qidx[order]]) / n
    values = stat[order]
    # at a tie the whole tied group is kept: the recall reached at a level is the last cumsum of its group
    last_of_value = np.r_[values[1:] != values[:-1], True]
    ok = np.flatnonzero(last_of_value & (gain >= need - 1e-12))
    if len(ok) == 0:
        return -np.inf, False
    return float(values[ok[0]]), True


def conformal_resplits(
    stat: np.ndarray,
    qidx: np.ndarray,
    is_rel: np.ndarray,
    n_rel: np.ndarray,
    target: float,
    n_cal: int,
    seeds: int = 200,
    seed: int = 0,
) -> np.ndarray:
    """The test mean recall of each of ``seeds`` random splits of the queries (``n_cal`` calibrate the level by
    :func:`conformal_recall_level`, the rest test it; ``default_rng(seed)``): the guarantee is on the recall
    expected over the draw, so the mean over many splits is at least the target up to Monte Carlo error."""
    has = np.flatnonzero(n_rel > 0)
    if not 1 <= n_cal < len(has):
        raise ValueError(f"n_cal must be in [1, {len(has) - 1}] (queries with a relevant document: {len(has)})")
    rows = np.flatnonzero(is_rel & (n_rel[qidx] > 0))
    r_stat, r_q = stat[rows], qidx[rows]
    rng = np.random.default_rng(seed)
    out = np.empty(seeds)
    for b in range(seeds):
        cal = np.zeros(len(n_rel), dtype=bool)
        cal[rng.permutation(has)[:n_cal]] = True
        in_cal = cal[r_q]
        lam, _ = conformal_recall_level(r_stat[in_cal], r_q[in_cal], in_cal[in_cal], np.where(cal, n_rel, 0), target)
        test = ~cal & (n_rel > 0)
        hits = np.bincount(r_q[~in_cal & (r_stat >= lam)], minlength=len(n_rel))
        out[b] = np.mean(hits[test] / n_rel[test])
    return out


def _on_or_below(a: tuple, b: tuple, x: float, y: float) -> bool:
    """Whether point ``b`` lies on or below the chord from ``a`` to ``(x, y)``."""
    return (b[1] - a[1]) * (x - a[0]) <= (y - a[1]) * (b[0] - a[0])


def oracle_runs(ranked: pd.DataFrame, is_rel: np.ndarray, qidx: np.ndarray, n_rel: np.ndarray, k: float, n_q: int):
    """Per-query depths maximising total recall under a mean-depth budget ``k`` (qrels known: an upper bound): the
    segments of each query's upper concave (depth, recall) hull, best gain per document first, while they fit."""
    budget = k * n_q
    segs = []
    ranks = ranked["rank"].to_numpy()
    for q in range(n_q):
        if n_rel[q] == 0:
            continue
        rel_ranks = np.sort(ranks[(qidx == q) & is_rel])
        pts = [(0, 0.0)] + [(int(r) + 1, (j + 1) / n_rel[q]) for j, r in enumerate(rel_ranks)]
        hull = [pts[0]]
        for x, y in pts[1:]:
            while len(hull) >= 2 and _on_or_below(hull[-2], hull[-1], x, y):
                hull.pop()
            hull.append((x, y))
        segs += [((y2 - y1) / (x2 - x1), q, x2, x2 - x1) for (x1, y1), (x2, y2) in zip(hull, hull[1:])]
    depth = np.zeros(n_q, dtype=int)
    spent = 0.0
    for _slope, q, x2, cost in sorted(segs, key=lambda s: -s[0]):
        if x2 > depth[q] and spent + cost <= budget:
            depth[q], spent = x2, spent + cost
    return ranked[ranks < depth[qidx]]


def row_relevance(ranked: pd.DataFrame, qrels: pd.DataFrame, qids: Sequence[str]):
    """(query index per row, relevant flag per row, number of judged-relevant documents per query)."""
    rel = qrels[qrels["label"] > 0]
    pairs = set(zip(rel["qid"].astype(str), rel["docno"].astype(str)))
    qidx = ranked["qid"].map({q: i for i, q in enumerate(qids)}).to_numpy()
    is_rel = np.fromiter((p in pairs for p in zip(ranked["qid"], ranked["docno"])), bool, len(ranked))
    counts = rel.groupby(rel["qid"].astype(str)).size()
    return qidx, is_rel, np.array([int(counts.get(q, 0)) for q in qids])


def mean_measures(qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, keep: np.ndarray, n_q: int):
    """Mean depth, and SetR / SetP / F1 per query (recall over queries with a relevant document)."""
    depth = np.bincount(qidx[keep], minlength=n_q)
    hits = np.bincount(qidx[keep & is_rel], minlength=n_q)
    has = n_rel > 0
    rec = np.where(has, hits / np.maximum(n_rel, 1), 0.0)
    prec = np.where(depth > 0, hits / np.maximum(depth, 1), 0.0)
    f1 = np.where(rec + prec > 0, 2 * rec * prec / np.maximum(rec + prec, 1e-12), 0.0)
    return depth.mean(), rec[has].mean(), prec[has].mean(), f1[has].mean()


Statistic = Callable[[pd.DataFrame], np.ndarray]


def _sorted_run(run: pd.DataFrame) -> pd.DataFrame:
    """``run`` with str qids and docnos, each query's rows together in rank order (queries as they first appear)."""
    if missing := [c for c in ("qid", "docno", "score", "rank") if c not in run.columns]:
        raise ValueError(f"a ranked run needs the columns qid, docno, score, rank; missing {missing}")
    run = run.assign(qid=run["qid"].astype(str), docno=run["docno"].astype(str))
    return run.assign(_o=pd.factorize(run["qid"])[0]).sort_values(["_o", "rank"], kind="stable").drop(columns="_o")


class RecallTargetCutoff(pt.Transformer):
    """Truncate each ranked list at the level conformal risk control picks on calibration queries
    (:func:`conformal_recall_level`): expected recall >= ``target`` on a new, exchangeable query.

    ``statistic``: ``"score"``, ``"rank"`` (top-k), ``"zscore"`` or a callable ``run -> array`` (e.g.
    ``lambda run: law_stat(run, law)``). Use ``RecallTargetCutoff(0.9).fit(cal_run, cal_qrels)`` after a retriever
    that returns enough documents per query; :meth:`fit` sets ``level_`` and ``reachable_``.
    """

    def __init__(self, target: float, statistic: str | Statistic = "score") -> None:
        if not (isinstance(target, (int, float)) and 0.0 < target < 1.0):
            raise ValueError(f"target must be a recall in (0, 1), got {target!r}")
        named = {"score": lambda r: r["score"].to_numpy(dtype=np.float64), "zscore": zscore_stat}
        named["rank"] = lambda r: -r["rank"].to_numpy(dtype=np.float64)
        if isinstance(statistic, str) and statistic not in named:
            raise ValueError(f"statistic must be one of {sorted(named)} or a callable, got {statistic!r}")
        self.target = float(target)
        self.statistic = named[statistic] if isinstance(statistic, str) else statistic
        self.level_: float | None = None
        self.reachable_: bool | None = None

    def fit(self, run: pd.DataFrame, qrels: pd.DataFrame) -> RecallTargetCutoff:
        """Choose the level on a ranked run of calibration queries and their qrels (``qid, docno, label``)."""
        run = _sorted_run(run)
        qidx, is_rel, n_rel = row_relevance(run, qrels, list(dict.fromkeys(run["qid"])))
        self.level_, self.reachable_ = conformal_recall_level(self.statistic(run), qidx, is_rel, n_rel, self.target)
        return self

    def transform(self, run: pd.DataFrame) -> pd.DataFrame:
        if self.level_ is None:
            raise ValueError("RecallTargetCutoff is not fitted: call .fit(calibration_run, calibration_qrels) first")
        run = run.reset_index(drop=True)
        ranked = _sorted_run(run)  # str qids and docnos for the statistic; the rows are returned as they came in
        return run.iloc[ranked.index[self.statistic(ranked) >= self.level_]].reset_index(drop=True)

    def __repr__(self) -> str:
        return f"RecallTargetCutoff(target={self.target}, level={self.level_})"
