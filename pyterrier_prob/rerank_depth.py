"""Re-rank only as deep as each query needs: a per-query re-ranking depth chosen by a rule fitted on dev or
calibration queries, in a PyTerrier pipeline (``first_stage >> DepthRerank(rule, reranker)``).

One convention for every rule: each query's top ``d_q`` candidates of the first stage are re-ranked and come first,
then the rest of the first stage's list in its own order, so every run has the first stage's length and nDCG@10 of
two rules compares like with like. Rules (each ``fit`` on dev, then ``depths(run)``):

- :class:`FixedDepth`: the same ``k`` for every query;
- :class:`StatisticDepth`: the longest prefix whose statistic (non-increasing down the list: the first stage's
  z-score, a score-distribution posterior, pEBR's CDF law, the recall gain -- :mod:`pyterrier_prob.pebr.rlt`) stays
  at or above a level, the level fitted on dev to a mean depth (Arampatzis, Kamps & Robertson, SIGIR 2009; Meng et al.,
  SIGIR 2024, compare such rules for re-ranking);
- :class:`ConformalRecallDepth`: the level chosen by conformal risk control (Angelopoulos et al., ICLR 2024) so that
  a new query keeps, in expectation, at least ``target`` of the relevant documents among the first stage's top
  ``max_depth`` (Li et al., EMNLP 2022, prune a re-ranker's candidates so).

:func:`rerank_at_depths` replays a re-ranker's scores of the top ``max_depth`` at any per-query depths (a pair's
score does not depend on the depth), for cost-effectiveness curves; :func:`oracle_depths` is the smallest depth per
query whose re-ranked nDCG@10 equals that of the full depth."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.pebr.rlt import conformal_recall_level, level_for_depth, row_relevance, running_min, zscore_stat
from pyterrier_prob.validation import positive_int

__all__ = [
    "ConformalRecallDepth",
    "DepthRerank",
    "DepthRule",
    "EET_ALPHA",
    "EET_BETAS",
    "FirstPassDepth",
    "FixedDepth",
    "LearnedDepth",
    "StatisticDepth",
    "eet",
    "fixed_at_depth",
    "kept_recall",
    "list_features",
    "oracle_depths",
    "rerank_at_depths",
]

Statistic = Callable[[pd.DataFrame], np.ndarray]
STATISTICS: dict[str, Statistic] = {
    "score": lambda r: r["score"].to_numpy(dtype=np.float64),
    "zscore": zscore_stat,
    "rank": lambda r: -r["rank"].to_numpy(dtype=np.float64),  # a level on it is a fixed depth
}


def _ranked(run: pd.DataFrame) -> pd.DataFrame:
    """``run`` with str qids and docnos, each query's rows together in first-stage rank order (queries as they first
    come), index reset; ``rank`` recomputed from 0 when absent."""
    if missing := [c for c in ("qid", "docno", "score") if c not in run.columns]:
        raise ValueError(f"a first-stage run needs the columns qid, docno, score (and rank); missing {missing}")
    run = run.assign(qid=run["qid"].astype(str), docno=run["docno"].astype(str))
    if "rank" not in run.columns:
        run = run.assign(_s=-run["score"]).sort_values(["qid", "_s"], kind="stable").drop(columns="_s")
        run = run.assign(rank=run.groupby("qid").cumcount())
    order = pd.factorize(run["qid"])[0]
    return run.assign(_o=order).sort_values(["_o", "rank"], kind="stable").drop(columns="_o").reset_index(drop=True)


class DepthRule:
    """A per-query re-ranking depth: :meth:`fit` on a dev run (and its qrels when the rule needs them), then
    :meth:`depths` of a run (qid -> depth in ``[min_depth, max_depth]``, never beyond the query's list)."""

    def __init__(self, max_depth: int = 100, min_depth: int = 1) -> None:
        self.max_depth, self.min_depth = positive_int("max_depth", max_depth), positive_int("min_depth", min_depth)
        if self.min_depth > self.max_depth:
            raise ValueError(f"min_depth ({min_depth}) exceeds max_depth ({max_depth})")

    def fit(self, run: pd.DataFrame, qrels: pd.DataFrame | None = None) -> DepthRule:
        return self

    def _raw(self, ranked: pd.DataFrame) -> pd.Series:  # pragma: no cover - abstract
        raise NotImplementedError

    def depths(self, run: pd.DataFrame) -> pd.Series:
        """Each query's depth (qid -> int), queries in the order they come."""
        ranked = _ranked(run)
        ranked = ranked[ranked["rank"] < self.max_depth]
        sizes = ranked.groupby("qid", sort=False).size()
        raw = self._raw(ranked).reindex(sizes.index).fillna(0)
        return np.minimum(np.clip(raw, self.min_depth, self.max_depth), sizes).astype(np.int64).rename("depth")


class FixedDepth(DepthRule):
    """The same depth ``k`` for every query (fixed-k, the baseline every rule is judged against)."""

    def __init__(self, k: int, max_depth: int | None = None) -> None:
        k = positive_int("k", k)
        super().__init__(max_depth=max(k, max_depth or k), min_depth=1)
        self.k = k

    def _raw(self, ranked: pd.DataFrame) -> pd.Series:
        return pd.Series(self.k, index=pd.unique(ranked["qid"]), dtype=np.int64)

    def __repr__(self) -> str:
        return f"FixedDepth({self.k})"


class StatisticDepth(DepthRule):
    """The longest prefix of each list whose statistic (running minimum down the list) is ``>= level``.

    ``statistic``: ``"zscore"`` (the first stage's score standardised over the query's top ``max_depth``),
    ``"score"``, ``"rank"`` (a fixed depth), or a callable ``ranked run -> array``
    (``lambda r: law_stat(r, law)``: pEBR's CDF;
    :func:`~pyterrier_prob.pebr.rlt.gain_stat`: the recall gain; :func:`~pyterrier_prob.pebr.rlt.mixture_stat`: the
    score-distribution posterior). :meth:`fit` sets ``level`` so that the dev queries re-rank ``mean_depth``
    candidates on average (or keep a given ``level``)."""

    def __init__(
        self,
        statistic: str | Statistic = "zscore",
        mean_depth: float | None = None,
        level: float | None = None,
        max_depth: int = 100,
        min_depth: int = 1,
    ) -> None:
        super().__init__(max_depth, min_depth)
        if (mean_depth is None) == (level is None):
            raise ValueError("give StatisticDepth one of mean_depth (fitted on dev) or level")
        if isinstance(statistic, str) and statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {sorted(STATISTICS)} or a callable, got {statistic!r}")
        self.name = statistic if isinstance(statistic, str) else getattr(statistic, "__name__", "statistic")
        self.statistic = STATISTICS[statistic] if isinstance(statistic, str) else statistic
        self.mean_depth, self.level = mean_depth, level

    def _stat(self, ranked: pd.DataFrame) -> np.ndarray:
        return running_min(ranked, np.asarray(self.statistic(ranked), dtype=np.float64))

    def fit(self, run: pd.DataFrame, qrels: pd.DataFrame | None = None) -> StatisticDepth:
        if self.mean_depth is not None:
            ranked = _ranked(run)
            ranked = ranked[ranked["rank"] < self.max_depth].reset_index(drop=True)
            self.level = level_for_depth(self._stat(ranked), ranked["qid"].nunique(), float(self.mean_depth))
        return self

    def _raw(self, ranked: pd.DataFrame) -> pd.Series:
        if self.level is None:
            raise ValueError(f"{self!r} is not fitted: call .fit(dev_run) first")
        ranked = ranked.reset_index(drop=True)
        keep = self._stat(ranked) >= self.level
        return pd.Series(keep, index=ranked.index).groupby(ranked["qid"].to_numpy(), sort=False).sum()

    def __repr__(self) -> str:
        return f"StatisticDepth({self.name!r}, mean_depth={self.mean_depth}, level={self.level})"


class ConformalRecallDepth(StatisticDepth):
    """A depth that promises ``target`` of each query's relevant documents among the first stage's top ``max_depth``
    (macro mean over queries): the level of the statistic chosen on calibration queries by conformal risk control
    (:func:`~pyterrier_prob.pebr.rlt.conformal_recall_level`; the relevant documents outside the top ``max_depth``
    do not count, a re-ranker cannot reach them). ``statistic="rank"``: the fixed depth that keeps the promise."""

    def __init__(
        self, target: float, statistic: str | Statistic = "zscore", max_depth: int = 100, min_depth: int = 1
    ) -> None:
        if not (isinstance(target, int | float) and 0.0 < target < 1.0):
            raise ValueError(f"target must be a recall in (0, 1), got {target!r}")
        super().__init__(statistic, level=0.0, max_depth=max_depth, min_depth=min_depth)  # the level: fitted below
        self.target, self.level, self.reachable = float(target), None, None

    def fit(self, run: pd.DataFrame, qrels: pd.DataFrame | None = None) -> ConformalRecallDepth:
        if qrels is None:
            raise ValueError("ConformalRecallDepth.fit needs the calibration queries' qrels")
        ranked = _ranked(run)
        ranked = ranked[ranked["rank"] < self.max_depth].reset_index(drop=True)
        qids = list(pd.unique(ranked["qid"]))
        qidx, is_rel, _ = row_relevance(ranked, qrels, qids)
        n_rel = np.bincount(qidx[is_rel], minlength=len(qids))  # relevant among the top max_depth only
        self.level, self.reachable = conformal_recall_level(self._stat(ranked), qidx, is_rel, n_rel, self.target)
        return self

    @property
    def fixed_k(self) -> int | None:
        """With ``statistic="rank"``, once fitted: the one depth k the promise needs (a level on ``-rank`` keeps
        ranks ``0 .. floor(-level)``); otherwise None."""
        if self.name != "rank" or self.level is None:
            return None
        return int(min(np.floor(-self.level) + 1, self.max_depth))

    def __repr__(self) -> str:
        return f"ConformalRecallDepth({self.target}, {self.name!r}, level={self.level})"


def list_features(ranked: pd.DataFrame, max_depth: int = 100) -> pd.DataFrame:
    """Per query (in the order they come), features of its first-stage list's top ``max_depth`` scores for a learned
    depth: the top score, its gap to the second and its standardised value, the spread, and the gaps at 10 and 50,
    each over the list's standard deviation (scale-free), and the list's length."""
    ranked = ranked[ranked["rank"] < max_depth]
    rows = {}
    for qid, g in ranked.groupby("qid", sort=False):
        s = g["score"].to_numpy(dtype=np.float64)
        sd = float(s.std()) or 1.0
        at = s[np.minimum([1, 9, 49], len(s) - 1)]  # the 2nd, 10th and 50th scores (the last of a shorter list)
        rows[qid] = {
            "z_top1": (s[0] - s.mean()) / sd,
            "gap_1_2": (s[0] - at[0]) / sd,
            "gap_top10": (s[0] - at[1]) / sd,
            "gap_top50": (s[0] - at[2]) / sd,
            "spread": sd / (abs(s.mean()) or 1.0),
            "length": float(len(s)),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


class LearnedDepth(DepthRule):
    """A supervised ranked-list-truncation baseline (as Lien et al., ICTIR 2019, and the methods Meng et al., SIGIR
    2024, compare): ridge regression of log(1 + oracle depth) on :func:`list_features`, the ridge strength chosen among
    ``alphas`` by ``folds``-fold cross-validation on the dev queries (:func:`oracle_depths` of the dev run gives the
    targets), then the prediction scaled so that the dev queries re-rank ``mean_depth`` on average (None: as
    predicted)."""

    def __init__(
        self,
        mean_depth: float | None = None,
        alphas: tuple[float, ...] = (0.01, 0.1, 1.0, 10.0, 100.0),
        folds: int = 5,
        max_depth: int = 100,
        min_depth: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(max_depth, min_depth)
        self.mean_depth, self.alphas, self.folds, self.seed = (
            mean_depth,
            tuple(alphas),
            positive_int("folds", folds),
            seed,
        )
        self.coef_: np.ndarray | None = None

    def _design(self, ranked: pd.DataFrame) -> tuple[pd.Index, np.ndarray]:
        f = list_features(ranked, self.max_depth)
        return f.index, np.c_[np.ones(len(f)), (f.to_numpy() - self.mu_) / self.sd_]

    @staticmethod
    def _ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
        penalty = alpha * np.eye(x.shape[1])
        penalty[0, 0] = 0.0  # the intercept is not shrunk
        return np.linalg.solve(x.T @ x + penalty, x.T @ y)

    def fit(
        self, run: pd.DataFrame, qrels: pd.DataFrame | None = None, oracle: pd.Series | None = None
    ) -> LearnedDepth:
        if oracle is None:
            raise ValueError("LearnedDepth.fit needs the dev queries' oracle depths (oracle_depths of the dev run)")
        ranked = _ranked(run)
        f = list_features(ranked, self.max_depth)
        self.mu_, self.sd_ = f.mean().to_numpy(), f.std(ddof=0).replace(0.0, 1.0).to_numpy()
        index, x = self._design(ranked)
        y = np.log1p(oracle.reindex(index).astype(np.float64).to_numpy())
        if np.isnan(y).any():
            raise ValueError("oracle gives no depth for some dev queries of the run")
        fold = np.random.default_rng(self.seed).permutation(len(y)) % min(self.folds, len(y))
        errors = {}
        for a in self.alphas:  # cross-validated squared error of each ridge strength
            errors[a] = sum(
                float(((x[fold == k] @ self._ridge(x[fold != k], y[fold != k], a) - y[fold == k]) ** 2).sum())
                for k in np.unique(fold)
            )
        self.alpha_ = min(errors, key=lambda a: (errors[a], a))
        self.coef_, self.scale_ = self._ridge(x, y, self.alpha_), 1.0
        if self.mean_depth is not None:  # bisection on the scale of the predicted depth
            lo, hi = 1e-3, 1e3
            for _ in range(60):
                mid = (lo * hi) ** 0.5
                self.scale_ = mid
                lo, hi = (mid, hi) if self.depths(ranked).mean() < self.mean_depth else (lo, mid)
        return self

    def _raw(self, ranked: pd.DataFrame) -> pd.Series:
        if self.coef_ is None:
            raise ValueError(f"{self!r} is not fitted: call .fit(dev_run, oracle=oracle_depths(...)) first")
        index, x = self._design(ranked)
        return pd.Series(np.rint(self.scale_ * np.expm1(x @ self.coef_)), index=index)

    def __repr__(self) -> str:
        return f"LearnedDepth(mean_depth={self.mean_depth})"


class FirstPassDepth(DepthRule):
    """A cheap first pass decides: each query's top ``prefix`` rows carry a first-pass statistic (column ``column``,
    e.g. a VarCE's std[s] of those pairs, or a small cross-encoder's score spread), averaged per query; a query whose
    mean is above ``level`` (uncertain) is re-ranked to ``max_depth``, the others to ``prefix``. :meth:`fit` sets the
    level so that the dev queries re-rank ``mean_depth`` on average; the first pass's own pairs are the caller's to
    count (they are the prefix's, so with the same re-ranker nothing is scored twice)."""

    def __init__(self, prefix: int, mean_depth: float, column: str = "first_pass_std", max_depth: int = 100) -> None:
        super().__init__(max_depth, min_depth=positive_int("prefix", prefix))
        self.prefix, self.mean_depth, self.column, self.level = prefix, float(mean_depth), column, None

    def _stat(self, ranked: pd.DataFrame) -> pd.Series:
        if self.column not in ranked.columns:
            raise ValueError(f"FirstPassDepth reads the first pass's column {self.column!r}: the run has none")
        head = ranked[ranked["rank"] < self.prefix]
        if head[self.column].isna().any():
            raise ValueError(f"FirstPassDepth: {self.column!r} is missing on a row of some query's top {self.prefix}")
        return head.groupby("qid", sort=False)[self.column].mean()

    def fit(self, run: pd.DataFrame, qrels: pd.DataFrame | None = None) -> FirstPassDepth:
        stat = self._stat(_ranked(run))
        share = (self.mean_depth - self.prefix) / max(self.max_depth - self.prefix, 1)  # of queries sent deep
        self.level = float(np.quantile(stat, 1.0 - min(max(share, 0.0), 1.0))) if share < 1 else -np.inf
        return self

    def _raw(self, ranked: pd.DataFrame) -> pd.Series:
        if self.level is None:
            raise ValueError(f"{self!r} is not fitted: call .fit(dev_run) first")
        stat = self._stat(ranked)
        return pd.Series(np.where(stat > self.level, self.max_depth, self.prefix), index=stat.index)

    def __repr__(self) -> str:
        return f"FirstPassDepth(prefix={self.prefix}, mean_depth={self.mean_depth}, level={self.level})"


def _merge(ranked: pd.DataFrame, head_scores: np.ndarray, head: np.ndarray) -> pd.DataFrame:
    """The run: each query's re-ranked head (by ``head_scores``, ties in first-stage order) then its tail in first-stage
    order; ``score`` below every head score for the tail, ``rank`` from 0, ``reranked`` marks the head."""
    out = ranked.assign(reranked=head, _tail=~head)
    key = np.where(head, -np.asarray(head_scores, dtype=np.float64), 0.0)
    out = out.assign(_k=key, _o=pd.factorize(out["qid"])[0])
    out = out.sort_values(["_o", "_tail", "_k", "rank"], kind="stable").reset_index(drop=True)
    score = np.where(out["reranked"], -out["_k"], np.nan)
    floor = pd.Series(score).groupby(out["_o"].to_numpy()).transform("min").fillna(0.0).to_numpy()
    tail_pos = out.groupby("_o").cumcount().to_numpy() - out.groupby("_o")["reranked"].transform("sum").to_numpy()
    out["score"] = np.where(out["reranked"], score, floor - 1.0 - tail_pos)
    out["rank"] = out.groupby("_o").cumcount().astype(np.int64)
    return out.drop(columns=["_tail", "_k", "_o"])


def rerank_at_depths(run: pd.DataFrame, scores: np.ndarray | pd.Series, depths: pd.Series | int) -> pd.DataFrame:
    """``run`` (first stage: ``qid, docno, score, rank``) re-ranked per query at ``depths`` (qid -> depth, or one int)
    with the re-ranker's ``scores`` of its rows (aligned with ``run``; NaN allowed below each depth), by the module's
    convention: the head re-ranked, then the tail in first-stage order."""
    scores = pd.Series(np.asarray(scores, dtype=np.float64), index=run.index)
    ranked = _ranked(run.assign(_rr=scores.to_numpy()))
    d = depths if isinstance(depths, pd.Series) else pd.Series(int(depths), index=pd.unique(ranked["qid"]))
    head = ranked["rank"].to_numpy() < ranked["qid"].map(d.astype(np.int64)).fillna(0).to_numpy()
    if np.isnan(ranked["_rr"].to_numpy()[head]).any():
        raise ValueError("a re-ranked candidate has no re-ranker score (NaN): score the top max_depth of every query")
    return _merge(ranked.drop(columns="_rr"), ranked["_rr"].to_numpy(), head)


def oracle_depths(
    run: pd.DataFrame, scores: np.ndarray | pd.Series, qrels: pd.DataFrame, max_depth: int = 100
) -> pd.Series:
    """Per query, the smallest depth whose re-ranked nDCG@10 (:func:`rerank_at_depths`) equals that of re-ranking
    ``max_depth``: the depth an oracle of the qrels would choose, an upper bound on what a rule can save."""
    from pyterrier_prob.varce.distill import ndcg_at_10

    ranked = _ranked(run.assign(_rr=np.asarray(scores, dtype=np.float64)))
    qids = list(pd.unique(ranked["qid"]))
    sizes = ranked.groupby("qid", sort=False).size().clip(upper=max_depth)
    full = ndcg_at_10(rerank_at_depths(ranked, ranked["_rr"], sizes), qrels, qids=qids)
    best = pd.Series(sizes, dtype=np.int64)
    todo = list(qids)
    for d in range(0, max_depth + 1):  # the shallowest depth each query's full-depth value is reached at
        if not todo:
            break
        part = ranked[ranked["qid"].isin(todo)]
        at = ndcg_at_10(rerank_at_depths(part, part["_rr"], pd.Series(d, index=todo).clip(upper=sizes[todo])), qrels)
        done = [q for q in todo if abs(at.get(q, 0.0) - full[q]) <= 1e-12]
        best[done] = min(d, max_depth)
        todo = [q for q in todo if q not in set(done)]
    return best.rename("depth")


class DepthRerank(pt.Transformer):
    """``first_stage >> DepthRerank(rule, reranker)``: each query's top ``rule.depths`` candidates re-ranked by
    ``reranker`` (any PyTerrier re-ranker of ``qid, query, docno, ...`` frames), then the rest of the first stage's list
    in its own order (``score`` below the re-ranked ones; column ``reranked``). ``% k`` after it
    (:meth:`fuse_rank_cutoff`) keeps the final top ``k``; the depths never change with it."""

    def __init__(self, rule: DepthRule, reranker: pt.Transformer, num_results: int | None = None) -> None:
        if not isinstance(rule, DepthRule):
            raise TypeError(f"rule must be a DepthRule (FixedDepth, StatisticDepth, ...), got {type(rule).__name__}")
        self.rule, self.reranker = rule, reranker
        self.num_results = positive_int("num_results", num_results, allow_none=True)
        self.pairs_scored = 0  # every pair the re-ranker scored, over the calls so far

    def subtransformers(self) -> Mapping[str, Any]:
        return {"reranker": self.reranker}

    def fuse_rank_cutoff(self, k: int) -> DepthRerank:
        return DepthRerank(self.rule, self.reranker, k if self.num_results is None else min(k, self.num_results))

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pt.validate.result_frame(inp, extra_columns=["query"])
        if inp.empty:
            return inp.assign(reranked=pd.Series(dtype=bool))
        ranked = _ranked(inp)
        depth = self.rule.depths(ranked)
        head = ranked["rank"].to_numpy() < ranked["qid"].map(depth).to_numpy()
        top = ranked[head]
        self.pairs_scored += int(len(top))
        scored = self.reranker(top)  # with the first stage's score: a re-ranker may read it (input_score)
        key = pd.MultiIndex.from_frame(top[["qid", "docno"]])
        back = scored.assign(qid=scored["qid"].astype(str), docno=scored["docno"].astype(str))
        new = back.set_index(["qid", "docno"])["score"].reindex(key)
        if new.isna().any():
            raise ValueError(f"the re-ranker {self.reranker!r} dropped or renamed candidates it was given")
        scores = np.full(len(ranked), np.nan)
        scores[np.flatnonzero(head)] = new.to_numpy(dtype=np.float64)
        out = _merge(ranked, scores, head)
        return out if self.num_results is None else out[out["rank"] < self.num_results].reset_index(drop=True)

    def __repr__(self) -> str:
        cut = f" % {self.num_results}" if self.num_results else ""
        return f"DepthRerank({self.rule!r}, {self.reranker!r}){cut}"


def kept_recall(run: pd.DataFrame, depths: pd.Series, qrels: pd.DataFrame, max_depth: int = 100) -> float:
    """The share of each query's relevant documents among the first stage's top ``max_depth`` that its depth keeps,
    macro-averaged over the queries with at least one there (what :class:`ConformalRecallDepth` promises)."""
    ranked = _ranked(run)
    ranked = ranked[ranked["rank"] < max_depth].reset_index(drop=True)
    qids = list(pd.unique(ranked["qid"]))
    qidx, is_rel, _ = row_relevance(ranked, qrels, qids)
    n_rel = np.bincount(qidx[is_rel], minlength=len(qids))
    kept = is_rel & (ranked["rank"].to_numpy() < ranked["qid"].map(depths).fillna(0).to_numpy())
    hits = np.bincount(qidx[kept], minlength=len(qids))
    has = n_rel > 0
    return float(np.mean(hits[has] / n_rel[has])) if has.any() else float("nan")


def fixed_at_depth(fixed: Mapping[int, pd.Series], depth: float) -> pd.Series:
    """Per-query values of fixed-k at a mean depth between the grid's ks: ``w * v(k_hi) + (1 - w) * v(k_lo)`` with
    ``k_lo <= depth <= k_hi`` neighbours of the grid and ``w = (depth - k_lo) / (k_hi - k_lo)`` (the expected value of
    choosing k_hi with probability w): fixed-k at the same mean number of re-ranked pairs."""
    ks = sorted(fixed)
    if not ks[0] <= depth <= ks[-1]:
        raise ValueError(f"depth {depth:g} is outside the fixed-k grid [{ks[0]}, {ks[-1]}]")
    hi = next(k for k in ks if k >= depth)
    lo = max(k for k in ks if k <= depth)
    if hi == lo:
        return fixed[hi]
    w = (depth - lo) / (hi - lo)
    return w * fixed[hi] + (1 - w) * fixed[lo]


#: The efficiency-effectiveness trade-off's settings of Meng et al. (SIGIR 2024): the depth penalty and the betas.
EET_ALPHA = -0.001
EET_BETAS = (0.0, 1.0, 2.0)


def eet(
    quality: np.ndarray | pd.Series,
    quality_at_1: np.ndarray | pd.Series,
    depth: np.ndarray | pd.Series,
    alpha: float = EET_ALPHA,
    beta: float = 1.0,
) -> np.ndarray:
    """Per query, the efficiency-effectiveness trade-off (EET) of re-ranking to ``depth`` (Meng et al., SIGIR 2024,
    "Ranked List Truncation for Large Language Model-based Re-Ranking"): an F-measure of the effectiveness
    ``e = max(0, quality - quality_at_1)`` (the gain over re-ranking the top 1 alone, i.e. over the first stage's
    order) and the efficiency ``f = exp(alpha * k)``, ``k = max(depth, 1)``:
    ``EET = (1 + beta^2) e f / (beta^2 e + f)``. ``beta = 0`` is the effectiveness alone; a larger ``beta`` weighs
    the efficiency more (``beta -> inf``: ``f``). Their settings: ``alpha = -0.001``, ``beta`` in {0, 1, 2}."""
    if alpha > 0:
        raise ValueError(f"alpha must be <= 0 (a penalty on depth), got {alpha}")
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    e = np.clip(np.asarray(quality, dtype=np.float64) - np.asarray(quality_at_1, dtype=np.float64), 0.0, None)
    f = np.exp(alpha * np.maximum(np.asarray(depth, dtype=np.float64), 1.0))
    return (1 + beta**2) * e * f / (beta**2 * e + f)
