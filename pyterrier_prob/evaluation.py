"""Evaluation protocol of pEBR (``shared/papers/pebr.md``): matched mean depth, head/torso/tail strata, Table 3.

:func:`calibrate_mean_k` matches the mean depth of variable-depth retrievers (Sec. 4.1.3), :func:`assign_strata` splits
queries into strata (Sec. 4.2), :func:`evaluate_set_measures` gives Table 1 and :func:`table3_grid` Table 3 (Sec.
4.4.2). Counts are taken over an explicit query set, 0 for a query with no rows. Details: ``docs/pebr.md``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ir_measures
import numpy as np
import pandas as pd
from scipy import stats

from pyterrier_prob.validation import (
    EmptyRetrievalWarning,
    choice,
    finite_float,
    positive_float,
    positive_int,
    require_columns,
)

STRATA: tuple[str, str, str] = ("head", "torso", "tail")
"""Stratum labels, most popular first (pEBR Sec. 4.2)."""

POPULARITY_COLUMNS: tuple[str, ...] = ("popularity", "query_popularity", "frequency", "query_frequency")
"""Topic columns :func:`assign_strata` recognises as a query-popularity signal when none is named."""

NUM_REL_BASIS = "terciles of the number of relevant documents per query"

TABLE3_PS: tuple[float, ...] = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
"""The CDF values of pEBR Table 3 (Sec. 4.4.2)."""

Counts = pd.DataFrame | pd.Series | np.ndarray | Mapping[str, int] | Sequence[int]
"""What a ``run`` callable may return: a result frame, qid-indexed counts, or positional counts."""

StrataLike = pd.DataFrame | pd.Series | Mapping[str, str]
QRELS_COLUMNS = ["qid", "docno", "label"]


# --- counts per query ---------------------------------------------------------------------------------------------


def _topic_qids(topics: pd.DataFrame | Iterable[str]) -> pd.Index:
    if isinstance(topics, pd.DataFrame):
        require_columns(topics, ["qid"], "topics")
        topics = topics["qid"]
    return pd.Index(pd.Series(list(topics)).astype(str).drop_duplicates(), name="qid")


def retrieved_counts(result: Counts, qids: Iterable[str] | None = None) -> pd.Series:
    """Documents retrieved per query (qid-indexed int Series ``num_retrieved``) from a result frame or from counts (a
    qid-indexed Series or ``{qid: count}``); with ``qids``, over that query set (absent queries count 0, others drop).
    """
    if isinstance(result, pd.DataFrame):
        require_columns(result, ["qid"], "result frame")
        counts = result["qid"].astype(str).value_counts(sort=False)
    elif isinstance(result, pd.Series | Mapping):
        counts = result.copy() if isinstance(result, pd.Series) else pd.Series(dict(result), dtype=object)
        counts.index = counts.index.astype(str)
        _check_counts(pd.to_numeric(counts, errors="coerce").to_numpy(dtype=float), counts.index, counts.to_numpy())
        counts = pd.to_numeric(counts)
    else:
        raise TypeError(
            "retrieved_counts needs a result frame, a qid-indexed Series or a {qid: count} mapping, "
            f"got {type(result).__name__} (positional arrays carry no qids)"
        )
    if qids is not None:
        counts = counts.reindex(_topic_qids(qids), fill_value=0)
    counts = counts.fillna(0)
    if len(counts) and (counts < 0).any():
        raise ValueError("retrieved counts must be >= 0")
    return counts.astype(np.int64).rename("num_retrieved").rename_axis("qid")


def _check_counts(values: np.ndarray, qids: Any = None, raw: Any = None, call: str = "") -> None:
    """Counts must be finite numbers: a nan (a missing count) or inf is an error naming the query, not a 0."""
    if (bad := ~np.isfinite(values)).any():
        i = int(np.flatnonzero(bad)[0])
        where = f"qid {qids[i]!r}" if qids is not None else f"position {i}"
        shown = raw[i] if raw is not None else values[i]
        shown = shown.item() if isinstance(shown, np.generic) else shown
        more = f" (and {int(bad.sum()) - 1} more)" if bad.sum() > 1 else ""
        raise ValueError(
            f"{f'{call}: ' if call else ''}retrieved counts must be finite numbers, got {shown!r} for {where}{more}"
        )


def _quiet_run(run: Callable[[Any], Any], x: Any) -> Any:
    """``run(x)`` without :class:`EmptyRetrievalWarning` (a search's low levels retrieve nothing by design)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyRetrievalWarning)
        return run(x)


def _run_counts(run: Callable[[Any], Counts], x: Any, call: str, n: int | None) -> tuple[Any, pd.Series | np.ndarray]:
    """``(answer, counts)`` of ``run(x)``: positional (a float array, ``n`` long when known) or qid-indexed counts."""
    out = _quiet_run(run, x)
    if not isinstance(out, np.ndarray | list | tuple):
        try:
            return out, retrieved_counts(out)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{call}: {e}") from e
    try:
        arr = np.asarray(out, dtype=float).ravel()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{call} returned counts that are not numbers: {e}") from e
    _check_counts(arr, call=call)
    if n is not None and len(arr) != n:
        raise ValueError(
            f"{call} returned {len(arr)} positional counts but the query set (topics or strata) has {n} queries: "
            "positional counts need topics or strata of the same length"
        )
    if (arr < 0).any():
        raise ValueError(f"{call} returned negative counts")
    return out, arr


def strata_series(strata: StrataLike) -> pd.Series:
    """qid -> stratum label, from a frame with ``qid, stratum``, a qid-indexed Series, or a mapping."""
    if isinstance(strata, pd.DataFrame):
        require_columns(strata, ["qid", "stratum"], "strata")
        s = pd.Series(strata["stratum"].to_numpy(), index=strata["qid"].to_numpy())
    elif isinstance(strata, pd.Series | Mapping):
        s = strata.copy() if isinstance(strata, pd.Series) else pd.Series(dict(strata))
    else:
        raise TypeError(f"strata must be a frame (qid, stratum), a Series or a mapping, got {type(strata).__name__}")
    if s.empty:
        raise ValueError("strata is empty: no query has a stratum")
    s.index = s.index.astype(str)
    s = s.astype(object)
    if s.isna().any():
        raise ValueError(f"strata has no stratum for qid(s) {list(s.index[s.isna()][:5])}")
    if (s.groupby(level=0).nunique() > 1).any():
        dup = list(s.index[s.index.duplicated()].unique()[:5])
        raise ValueError(f"strata gives qid(s) {dup} more than one stratum")
    return s[~s.index.duplicated()].rename("stratum").rename_axis("qid")


def stratum_order(labels: Iterable[Any]) -> list[Any]:
    """The distinct stratum labels in reading order: head, torso, tail (:data:`STRATA`), then any other, sorted."""
    present = list(dict.fromkeys(labels))
    return [s for s in STRATA if s in present] + sorted((s for s in present if s not in STRATA), key=str)


# --- 1. matched average k (Sec. 4.1.3) ----------------------------------------------------------------------------


@dataclass
class Calibration:
    """Outcome of :func:`calibrate_mean_k`: the ``value`` chosen (closest mean count; an int with ``integer=True``), its
    ``mean_k``, the ``target_k``, the ``iterations`` (calls to ``run``), whether ``achieved`` (within ``rel_tol``), the
    result ``frame`` at ``value`` (when ``run`` returns frames), per-query ``counts`` and the ``history`` of ``(x,
    mean_k)``."""

    value: float
    mean_k: float
    target_k: float
    iterations: int
    achieved: bool
    frame: pd.DataFrame | None = None
    counts: pd.Series | np.ndarray | None = None
    history: list[tuple[float, float]] = field(default_factory=list)


class _MeanKSearch:
    """The bisection of :func:`calibrate_mean_k`: per-call counts, the qid universe, the closest frame."""

    def __init__(self, run: Callable[[Any], Counts], topics: Any, target: float, tol: float, increasing: bool) -> None:
        self.run, self.target, self.tol, self.increasing = run, target, tol, increasing
        self.direction = "increasing" if increasing else "decreasing"
        self.fixed = topics is not None
        self.universe = _topic_qids(topics) if self.fixed else pd.Index([], name="qid")
        self.counts: dict[Any, pd.Series | np.ndarray] = {}  # by x, in the order of evaluation
        self.calls = 0
        self.frame_x: Any = None
        self.frame: pd.DataFrame | None = None
        self.positional: bool | None = None

    def __call__(self, x: Any) -> float:
        out, counts = _run_counts(self.run, x, f"run({x!r})", len(self.universe) if self.fixed else None)
        self.calls += 1
        positional = isinstance(counts, np.ndarray)
        if self.positional not in (None, positional):
            raise TypeError("run must return the same kind of answer (frame/Series or array) at every value")
        self.positional = positional
        if not positional and not self.fixed:  # with topics, mean() drops other qids and counts missing ones 0
            self.universe = self.universe.union(counts.index)
        self.counts[x] = counts
        if isinstance(out, pd.DataFrame) and (self.frame is None or self.miss(x) <= self.miss(self.frame_x)):
            self.frame_x, self.frame = x, out
        return self.mean(x)

    def mean(self, x: Any) -> float:
        c = self.series(x)
        return float(c.sum()) / len(c) if len(c) else 0.0

    def series(self, x: Any) -> pd.Series | np.ndarray:
        c = self.counts[x]
        return c if isinstance(c, np.ndarray) else c.reindex(self.universe, fill_value=0).astype(np.int64)

    def miss(self, x: Any) -> float:
        return abs(self.mean(x) - self.target)

    def done(self, x: Any, integer: bool) -> bool:
        return self.mean(x) == self.target if integer else self.miss(x) <= self.tol

    def check_ends(self, lo: Any, hi: Any) -> None:
        """Evaluate both ends; a ValueError when the count runs the other way or cannot reach the target."""
        self(lo)
        self(hi)
        f_a, f_b = self.mean(lo), self.mean(hi)  # recomputed: the qid universe may have grown at hi
        if (f_b < f_a) if self.increasing else (f_b > f_a):
            raise ValueError(
                f"mean retrieved count is {f_a:.6g} at lo={lo!r} and {f_b:.6g} at hi={hi!r}, which is not "
                f"{self.direction}; pass increasing={not self.increasing}"
            )
        k_min, k_max = min(f_a, f_b), max(f_a, f_b)
        if self.target < k_min - self.tol or self.target > k_max + self.tol:
            raise ValueError(
                f"target_k={self.target:g} is unreachable: for x in [{lo!r}, {hi!r}] the mean retrieved count per "
                f"query ranges over [{k_min:.6g}, {k_max:.6g}]; widen [lo, hi]"
            )

    def bisect(self, a: Any, b: Any, integer: bool, x_tol: float, max_iter: int) -> None:
        """Halve ``[a, b]`` until a midpoint is done, the bracket is exhausted or ``max_iter`` calls are spent."""
        if self.done(a, integer) or self.done(b, integer):
            return
        while self.calls < max_iter:
            mid = (a + b) // 2 if integer else a + (b - a) / 2
            if (b - a <= 1) if integer else (b - a <= x_tol or not a < mid < b):  # bracket exhausted
                return
            f_m = self(mid)
            f_a, f_b = self.mean(a), self.mean(b)
            eps = 1e-9 * max(1.0, abs(f_a), abs(f_b))
            low, high = (f_a, f_b) if self.increasing else (f_b, f_a)
            if f_m < low - eps or f_m > high + eps:
                raise ValueError(
                    "the mean retrieved count is not monotone in the parameter: "
                    f"{f_a:.6g} at x={a!r}, {f_m:.6g} at x={mid!r}, {f_b:.6g} at x={b!r} ({self.direction} expected)"
                )
            if self.done(mid, integer):
                return
            a, b = (mid, b) if (f_m < self.target) == self.increasing else (a, mid)

    def best(self) -> Any:
        """The closest mean; among equals the latest call (the tightest bracket, next to a jump in the count)."""
        ev = list(self.counts)
        return min(ev, key=lambda x: (self.miss(x), -ev.index(x)))

    def frame_at(self, x: Any) -> pd.DataFrame | None:
        if self.frame is None or self.frame_x == x:
            return self.frame
        self.calls += 1  # the qid universe grew after the frame was kept: fetch it again
        return _quiet_run(self.run, x)


def calibrate_mean_k(
    run: Callable[[Any], Counts],
    target_k: float,
    lo: float,
    hi: float,
    *,
    increasing: bool = True,
    rel_tol: float = 0.01,
    max_iter: int = 60,
    topics: pd.DataFrame | Iterable[str] | None = None,
    integer: bool = False,
    x_tol: float | None = None,
) -> Calibration:
    """The parameter value at which a variable-depth retriever retrieves ``target_k`` documents per query on average:
    pEBR's matched depth (Sec. 4.1.3), by monotone bisection on ``[lo, hi]`` (the rules: ``docs/pebr.md``).

    ``run`` maps ``x`` to a result frame (``qid``), qid-indexed counts or positional counts (same query order each
    call), e.g. ``lambda p: (encoder >> CDFCutoffRetriever(index, p=p)).transform(topics)``. ``increasing``: whether the
    count grows with ``x`` (p, top-k's k; not a cosine threshold); ``rel_tol``: success band relative to ``target_k``;
    ``max_iter``: most calls, both ends included; ``topics``: the query set (else the qids seen so far); ``integer``:
    bisect over integers (top-k); ``x_tol``: narrowest bracket (default ``1e-12 * (hi - lo)``). A target outside the
    ends' counts or a non-monotone count is a ValueError; a miss (count jumps, ``max_iter`` spent) gives
    ``achieved=False`` and a RuntimeWarning."""
    target = positive_float("target_k", target_k)
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
    finite_float("rel_tol", rel_tol, low=0.0, high=1.0, low_open=True, high_open=True)
    positive_int("max_iter", max_iter, minimum=2)  # both ends are evaluated
    if integer and (int(lo) != lo or int(hi) != hi):
        raise ValueError(f"integer=True needs integral lo and hi, got lo={lo!r}, hi={hi!r}")
    lo, hi = (int(lo), int(hi)) if integer else (lo, hi)
    x_tol = 1e-12 * (hi - lo) if x_tol is None else finite_float("x_tol", x_tol, low=0.0)
    tol = rel_tol * target
    search = _MeanKSearch(run, topics, target, tol, increasing)
    search.check_ends(lo, hi)
    search.bisect(lo, hi, integer, x_tol, max_iter)
    best = search.best()
    mean_k = search.mean(best)
    achieved = abs(mean_k - target) <= tol
    frame = search.frame_at(best)
    if not achieved:
        warnings.warn(
            f"calibrate_mean_k: closest mean count {mean_k:.6g} at x={best!r} misses target_k={target:g} by more "
            f"than {rel_tol:.2%} after {search.calls} runs (the count may jump over the target, e.g. tied scores)",
            RuntimeWarning,
            stacklevel=2,
        )
    history = [(x, search.mean(x)) for x in search.counts]
    return Calibration(best, mean_k, target, search.calls, achieved, frame, search.series(best), history)


# --- 2. head / torso / tail strata (Sec. 4.2) ---------------------------------------------------------------------


def _popularity(topics: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(qids, values, labels)`` of a popularity column: ``labels`` when it holds head/torso/tail, else None."""
    frame = topics[["qid", column]].assign(qid=topics["qid"].astype(str)).drop_duplicates("qid")
    values = frame[column]
    if values.isna().any():
        raise ValueError(f"popularity column {column!r} has missing values")
    labels = values.astype(str).str.lower()
    if not pd.api.types.is_numeric_dtype(values) and labels.isin(STRATA).all():
        return frame["qid"].to_numpy(), np.full(len(frame), np.nan), labels.to_numpy()
    try:
        values = pd.to_numeric(values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"popularity column {column!r} must be numeric or hold head/torso/tail labels") from e
    return frame["qid"].to_numpy(), values.to_numpy(dtype=float), None


def _num_relevant(topics: pd.DataFrame | None, qrels: pd.DataFrame, min_label: int) -> tuple[np.ndarray, np.ndarray]:
    """``(qids, number of documents with label >= min_label)`` of the topics (else of the qrels' queries)."""
    require_columns(qrels, QRELS_COLUMNS, "qrels")
    rel = qrels[qrels["label"] >= min_label]
    num_rel = rel.drop_duplicates(["qid", "docno"])["qid"].astype(str).value_counts()
    num_rel = num_rel.reindex(_topic_qids(topics if topics is not None else qrels), fill_value=0)
    return num_rel.index.to_numpy(), num_rel.to_numpy(dtype=float)


def assign_strata(
    topics: pd.DataFrame | None,
    qrels: pd.DataFrame | None = None,
    popularity_column: str | None = None,
    *,
    min_label: int = 1,
    ties: Literal["group", "split"] = "group",
) -> pd.DataFrame:
    """Split queries into head, torso and tail strata for pEBR Sec. 4.2 (Table 1).

    By terciles of query popularity (``popularity_column`` or one of :data:`POPULARITY_COLUMNS`, or its labels if it
    holds head/torso/tail), else of the number of relevant documents in ``qrels`` (label >= ``min_label``).
    ``ties="group"`` keeps equal values in one stratum (a warning names empty strata), ``"split"`` breaks ties by qid
    (``docs/pebr.md``). ``topics=None`` takes the qids of ``qrels``. Returns ``qid``, ``stratum`` (categorical head <
    torso < tail), ``value`` and ``basis`` (also in ``.attrs["basis"]``)."""
    choice("ties", ties, ("group", "split"))
    if topics is None and qrels is None:
        raise ValueError("assign_strata needs topics or qrels")
    if topics is not None:
        require_columns(topics, ["qid"], "topics")
    if popularity_column is not None:
        if topics is None or popularity_column not in topics.columns:
            have = [] if topics is None else list(topics.columns)
            raise ValueError(f"popularity column {popularity_column!r} is not in topics (columns: {have})")
    elif topics is not None:
        popularity_column = next((c for c in POPULARITY_COLUMNS if c in topics.columns), None)
    if popularity_column is not None:
        basis = f"popularity column {popularity_column}"
        qids, vals, labels = _popularity(topics, popularity_column)
        if labels is not None:
            return _finish_strata(pd.DataFrame({"qid": qids, "stratum": labels, "value": vals}), basis)
    elif qrels is None:
        raise ValueError(
            f"no popularity column in topics (looked for {list(POPULARITY_COLUMNS)}) and no qrels to count relevant "
            "documents from"
        )
    else:
        basis = NUM_REL_BASIS
        qids, vals = _num_relevant(topics, qrels, min_label)
    if (n := len(qids)) == 0:
        raise ValueError("assign_strata: no queries to stratify")
    if ties == "group":
        pos = pd.Series(vals).rank(method="average", ascending=False).to_numpy() - 1.0
    else:  # each query's place by value descending, then qid ascending
        pos = np.argsort(np.lexsort((qids.astype(str), -vals)))
    idx = np.minimum(np.floor(3.0 * (pos + 0.5) / n).astype(int), 2)
    out = pd.DataFrame({"qid": qids.astype(str), "stratum": np.asarray(STRATA, dtype=object)[idx], "value": vals})
    return _finish_strata(out, basis)


def _finish_strata(out: pd.DataFrame, basis: str) -> pd.DataFrame:
    out["stratum"] = pd.Categorical(out["stratum"], categories=list(STRATA), ordered=True)
    out["basis"] = basis
    out = out.sort_values(["stratum", "qid"], kind="stable").reset_index(drop=True)
    out.attrs["basis"] = basis
    if empty := [s for s in STRATA if not (out["stratum"] == s).any()]:
        warnings.warn(
            f"assign_strata ({basis}): stratum(s) {empty} are empty: too few queries or too many ties", stacklevel=3
        )
    return out


# --- 3. set measures per stratum (Sec. 4.1.3, Table 1) ------------------------------------------------------------


def parse_measures(measures: Sequence[Any] | str | Any) -> list[Any]:
    """ir_measures measures from one or several names or measure objects (``"nDCG@10"``, ``[R@100, "RR"]``)."""
    if isinstance(measures, str) or not isinstance(measures, Iterable):
        measures = [measures]
    parsed = [ir_measures.parse_measure(m) if isinstance(m, str) else m for m in measures]
    if not parsed:
        raise ValueError("no measures given")
    return parsed


def _evaluated_qids(qrels: pd.DataFrame, topics: pd.DataFrame | Iterable[str] | None, min_label: int) -> pd.Index:
    rel_q = pd.Index(qrels.loc[qrels["label"] >= min_label, "qid"].astype(str).unique(), name="qid")
    if topics is not None:
        tq = _topic_qids(topics)
        rel_q = tq[tq.isin(rel_q)]
    else:
        rel_q = rel_q.sort_values()
    if len(rel_q) == 0:
        raise ValueError(f"no query has a document with label >= {min_label} in qrels (within the topics)")
    return rel_q


def _stratum_of(qids: pd.Index, strata: StrataLike | None) -> pd.Series:
    """The stratum of each evaluated query (None without strata; a warning counts those without one)."""
    stratum = pd.Series(None, index=qids, dtype=object)
    if strata is None:
        return stratum
    s = strata_series(strata)
    common = qids[qids.isin(s.index)]
    if len(common) == 0:
        raise ValueError("strata share no qid with the evaluated queries (those with relevant documents)")
    stratum.loc[common] = s.loc[common].to_numpy()
    if len(qids) > len(common):
        warnings.warn(
            f"{len(qids) - len(common)} evaluated queries have no stratum; they count in 'all' only", stacklevel=3
        )
    return stratum


def _dict_of_dict(qid: pd.Series, docno: pd.Series, value: pd.Series) -> dict[str, dict[str, Any]]:
    """``{qid: {docno: value}}`` for ir_measures, built from numpy arrays (its own frame reader iterates rows)."""
    q = qid.astype(str).to_numpy(dtype=object)
    d = docno.astype(str).to_numpy(dtype=object)
    order = np.argsort(q, kind="stable")
    q, d, v = q[order], d[order], value.to_numpy()[order].tolist()
    if len(q) == 0:
        return {}
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    ends = np.r_[starts[1:], len(q)]
    return {q[s]: dict(zip(d[s:e].tolist(), v[s:e])) for s, e in zip(starts.tolist(), ends.tolist())}


def per_query_set_measures(
    runs: Mapping[str, pd.DataFrame],
    qrels: pd.DataFrame,
    strata: StrataLike | None = None,
    measures: Sequence[Any] | str = ("SetR", "SetP"),
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> pd.DataFrame:
    """Per-query values behind :func:`evaluate_set_measures`: ``name, qid, stratum, num_retrieved`` and one column per
    measure, one row per (system, query with a qrel of label >= ``min_label``); an empty query scores 0 (trec_eval -c).
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty mapping of name -> result frame")
    require_columns(qrels, QRELS_COLUMNS, "qrels")
    ms = parse_measures(measures)
    names = [str(m) for m in ms]
    qids = _evaluated_qids(qrels, topics, min_label)
    stratum = _stratum_of(qids, strata)
    q = qrels[qrels["qid"].astype(str).isin(qids)]
    irm_qrels = _dict_of_dict(q["qid"], q["docno"], q["label"].astype(int))
    frames = []
    for name, run in runs.items():
        require_columns(run, ["qid", "docno"], f"run {name!r}")
        r = run[run["qid"].astype(str).isin(qids)]
        if "score" not in r.columns and "rank" not in r.columns:
            raise ValueError(f"run {name!r} needs a 'score' or 'rank' column; it has {list(run.columns)}")
        score = r["score"].astype(float) if "score" in r.columns else -r["rank"].astype(float)
        values: dict[str, dict[str, float]] = {m: {} for m in names}
        for metric in ir_measures.iter_calc(ms, irm_qrels, _dict_of_dict(r["qid"], r["docno"], score)):
            values[str(metric.measure)][str(metric.query_id)] = float(metric.value)
        table = pd.DataFrame({m: pd.Series(v, dtype=float) for m, v in values.items()}, columns=names)
        out = table.reindex(qids).fillna(0.0).reset_index()
        out.insert(0, "name", name)
        out.insert(2, "stratum", stratum.to_numpy())
        out.insert(3, "num_retrieved", retrieved_counts(r, qids).to_numpy())
        frames.append(out)
    return pd.concat(frames, ignore_index=True)


def paired_p(x: pd.Series, y: pd.Series) -> float | None:
    """The paired t-test's p-value (``scipy.stats.ttest_rel``) of two per-query series over the qids both hold; None
    when there is nothing to test (fewer than two queries, or the same values)."""
    a, b = x.align(y, join="inner")
    if len(a) < 2 or np.allclose(a.to_numpy(), b.to_numpy()):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a constant non-zero difference: p = 0
        return float(stats.ttest_rel(a.to_numpy(), b.to_numpy()).pvalue)


def paired_ci(x: pd.Series, y: pd.Series, level: float = 0.95) -> list[float] | None:
    """The ``level`` confidence interval of the mean paired difference ``x - y`` (Student's t over the queries both
    hold); None when there is nothing to test (as :func:`paired_p`)."""
    a, b = x.align(y, join="inner")
    if paired_p(a, b) is None:
        return None
    ci = stats.ttest_rel(a.to_numpy(), b.to_numpy()).confidence_interval(level)
    return [float(ci.low), float(ci.high)]


def evaluate_set_measures(
    runs: Mapping[str, pd.DataFrame],
    qrels: pd.DataFrame,
    strata: StrataLike | None = None,
    measures: Sequence[Any] | str = ("SetR", "SetP"),
    *,
    baseline: str | None = None,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> pd.DataFrame:
    """Set measures of variable-depth runs, overall and per head/torso/tail stratum -- pEBR Table 1.

    At depths matched by :func:`calibrate_mean_k` ``SetP``/``SetR`` are the paper's P@k / R@k; any ``ir_measures``
    measure works (``"R@1500"``, ``ir_measures.SetR(rel=2)``). ``runs``: ``{name: frame}`` with ``qid, docno`` and
    ``score`` or ``rank``; ``strata`` from :func:`assign_strata` (``None``: "all" only). Returns one row per (system,
    stratum): ``name, stratum, n_queries, mean_k``, each measure's mean and, with ``baseline``, a ``"<measure>
    p-value"`` column per measure (paired t-test; NaN for the baseline and where undefined)."""
    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the runs {list(runs)}")
    per_q = per_query_set_measures(runs, qrels, strata, measures, topics=topics, min_label=min_label)
    names = [str(m) for m in parse_measures(measures)]
    groups: list[tuple[str, pd.Series]] = [("all", pd.Series(True, index=per_q.index))]
    if strata is not None:
        groups += [(s, per_q["stratum"] == s) for s in stratum_order(per_q["stratum"].dropna())]
    rows = []
    for name in runs:
        for label, in_group in groups:
            sel = per_q[(per_q["name"] == name) & in_group].set_index("qid")
            row: dict[str, Any] = {"name": name, "stratum": label, "n_queries": len(sel)}
            row["mean_k"] = float(sel["num_retrieved"].mean())
            row.update({m: float(sel[m].mean()) for m in names})
            if baseline is not None:
                base = per_q[(per_q["name"] == baseline) & in_group].set_index("qid")
                for m in names:
                    p = paired_p(sel[m], base[m])  # None for the baseline itself and wherever undefined
                    row[f"{m} p-value"] = math.nan if p is None else p
            rows.append(row)
    return pd.DataFrame(rows)


# --- 4. Table 3: mean retrieved count per stratum against the CDF value (Sec. 4.4.2) -----------------------------


def table3_grid(
    run_for_p: Callable[[float], Counts],
    ps: Sequence[float] = TABLE3_PS,
    strata: StrataLike | None = None,
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    include_all: bool = False,
) -> pd.DataFrame:
    """Mean number of retrieved documents per stratum for each CDF value -- pEBR Table 3 (Sec. 4.4.2).

    ``run_for_p`` maps p to a result frame, qid-indexed counts or positional counts in the order of ``strata`` (or
    ``topics``); a query with no rows counts 0. Without ``strata`` one ``all`` row over ``topics`` (or the qids seen);
    ``include_all`` adds it. Returns rows ``head, torso, tail`` (index ``stratum``) by columns ``p``."""
    ps = list(ps)
    if not ps:
        raise ValueError("ps is empty")
    s = strata_series(strata) if strata is not None else None
    qids = s.index if s is not None else (_topic_qids(topics) if topics is not None else None)
    cols: dict[float, pd.Series] = {}
    for p in ps:
        _, c = _run_counts(run_for_p, p, f"run_for_p({p!r})", 0 if qids is None else len(qids))
        cols[p] = pd.Series(c, index=qids) if isinstance(c, np.ndarray) else c.reindex(qids, fill_value=0)
    if s is None:
        universe = pd.Index(sorted(set().union(*(c.index for c in cols.values()))), name="qid")
        counts = pd.DataFrame({p: c.reindex(universe, fill_value=0) for p, c in cols.items()})
        table = counts.mean().to_frame("all").T
    else:
        counts = pd.DataFrame(cols).reindex(s.index, fill_value=0)
        table = counts.groupby(s.to_numpy(), sort=False).mean()
        table = table.loc[stratum_order(table.index)]
        if include_all:
            table.loc["all"] = counts.mean()
    table.index.name = "stratum"
    table.columns = pd.Index(ps, name="p")
    return table.astype(float)
