"""Evaluation protocol of pEBR: matched average depth, head/torso/tail strata, set measures, Table 3.

The pEBR paper (Sec. 4.1.3) compares a fixed top-k retriever with retrievers whose depth varies per query
(a cosine-score threshold, the pEBR CDF cutoff) by *adjusting each threshold until the average number of
retrieved items across all queries equals k* -- :func:`calibrate_mean_k` does that by monotone bisection.
Results are reported for all queries and separately for head, torso and tail queries (Sec. 4.2, Table 1) --
:func:`assign_strata` and :func:`evaluate_set_measures`; Sec. 4.4.2 studies how many items the CDF cutoff
retrieves per stratum as the CDF value changes (Table 3, :func:`table3_grid`; Figure 2,
:func:`pyterrier_prob.plots.retrieved_count_histogram`).

Result frames are PyTerrier frames (``qid, docno, score, rank`` + query columns) with a variable number of
rows per query; a query that retrieved nothing has no rows, so every count here is taken over an explicit
query set (the topics, the strata or the qrels) with 0 for the missing queries. Metrics come from
``ir_measures`` (``SetR``, ``SetP``, ``R@k``, ``nDCG@10``, ...); nothing here re-implements a metric.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from pyterrier_prob.validation import EmptyRetrievalWarning

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


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------


def _require_columns(frame: Any, columns: Iterable[str], what: str) -> None:
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{what} must be a pandas DataFrame, got {type(frame).__name__}")
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} lacks column(s) {missing}; it has {list(frame.columns)}")


def _topic_qids(topics: pd.DataFrame | Iterable[str]) -> pd.Index:
    if isinstance(topics, pd.DataFrame):
        _require_columns(topics, ["qid"], "topics")
        qids = topics["qid"]
    else:
        qids = pd.Series(list(topics))
    return pd.Index(qids.astype(str).drop_duplicates(), name="qid")


def retrieved_counts(result: Counts, qids: Iterable[str] | None = None) -> pd.Series:
    """Number of documents retrieved per query, as a qid-indexed integer Series named ``num_retrieved``.

    Args:
        result: a PyTerrier result frame (must have ``qid``; one row per retrieved document), or counts
            already: a qid-indexed Series or a ``{qid: count}`` mapping.
        qids: the query set to count over; queries absent from ``result`` count 0 (a variable-depth
            retriever returns no rows for a query whose cutoff keeps nothing) and queries outside ``qids``
            are dropped. Without it, the qids present in ``result``.
    """
    if isinstance(result, pd.DataFrame):
        _require_columns(result, ["qid"], "result frame")
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
    counts = counts.astype(np.int64)
    counts.index.name = "qid"
    counts.name = "num_retrieved"
    return counts


def _check_counts(values: np.ndarray, qids: Any = None, raw: Any = None) -> None:
    """Counts must be finite numbers: a nan (a missing count) or inf is an error naming the query, not a 0."""
    bad = ~np.isfinite(values)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        where = f"qid {qids[i]!r}" if qids is not None else f"position {i}"
        shown = raw[i] if raw is not None else values[i]
        shown = shown.item() if isinstance(shown, np.generic) else shown
        more = f" (and {int(bad.sum()) - 1} more)" if bad.sum() > 1 else ""
        raise ValueError(f"retrieved counts must be finite numbers, got {shown!r} for {where}{more}")


def _positional_counts(out: Any, call: str) -> np.ndarray:
    """Positional per-query counts (array, list, tuple) as float, checked: numbers, finite."""
    try:
        arr = np.asarray(out, dtype=float).ravel()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{call} returned counts that are not numbers: {e}") from e
    try:
        _check_counts(arr)
    except ValueError as e:
        raise ValueError(f"{call}: {e}") from e
    return arr


def _strata_series(strata: StrataLike) -> pd.Series:
    """qid -> stratum label, from a frame with ``qid, stratum``, a qid-indexed Series, or a mapping."""
    if isinstance(strata, pd.DataFrame):
        _require_columns(strata, ["qid", "stratum"], "strata")
        s = pd.Series(strata["stratum"].to_numpy(), index=strata["qid"].astype(str).to_numpy())
    elif isinstance(strata, pd.Series):
        s = strata.copy()
        s.index = s.index.astype(str)
    elif isinstance(strata, Mapping):
        s = pd.Series(dict(strata))
        s.index = s.index.astype(str)
    else:
        raise TypeError(f"strata must be a frame (qid, stratum), a Series or a mapping, got {type(strata).__name__}")
    if s.empty:
        raise ValueError("strata is empty: no query has a stratum")
    s = s.astype(object)
    if s.isna().any():
        raise ValueError(f"strata has no stratum for qid(s) {list(s.index[s.isna()][:5])}")
    if s.index.duplicated().any():
        dup = s.index[s.index.duplicated()].unique()
        if (s.groupby(level=0).nunique() > 1).any():
            raise ValueError(f"strata gives qid(s) {list(dup[:5])} more than one stratum")
        s = s[~s.index.duplicated()]
    s.index.name = "qid"
    s.name = "stratum"
    return s


def _stratum_order(labels: Iterable[Any]) -> list[Any]:
    present = list(dict.fromkeys(labels))
    known = [s for s in STRATA if s in present]
    return known + sorted((s for s in present if s not in STRATA), key=str)


# --------------------------------------------------------------------------------------------------------------
# 1. matched average k (Sec. 4.1.3)
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Calibration:
    """Outcome of :func:`calibrate_mean_k`.

    Attributes:
        value: the parameter value chosen (an ``int`` when ``integer=True``); the evaluated value whose mean
            count is closest to the target.
        mean_k: mean number of documents retrieved per query at ``value`` (queries with no rows count 0).
        target_k: the target asked for.
        iterations: how many times ``run`` was called (both ends of the bracket included).
        achieved: whether ``|mean_k - target_k| <= rel_tol * target_k``.
        frame: the result frame at ``value`` when ``run`` returns frames, else ``None``.
        counts: per-query counts at ``value`` (qid-indexed Series; an array when ``run`` returns arrays).
        history: ``(x, mean_k)`` of every call, in call order.
    """

    value: float
    mean_k: float
    target_k: float
    iterations: int
    achieved: bool
    frame: pd.DataFrame | None = None
    counts: pd.Series | np.ndarray | None = None
    history: list[tuple[float, float]] = field(default_factory=list)


def _quiet_run(run: Callable[[Any], Any], x: Any) -> Any:
    """``run(x)`` without :class:`~pyterrier_prob.validation.EmptyRetrievalWarning`: the bisection's levels retrieve
    nothing for most queries by design (the lower bracket), and a warning naming calibrate_mean_k would be noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptyRetrievalWarning)
        return run(x)


class _CountingRun:
    """Calls ``run(x)``, turns each answer into per-query counts and keeps the qid universe."""

    def __init__(self, run: Callable[[Any], Counts], topics: pd.DataFrame | Iterable[str] | None):
        self.run = run
        self.fixed = topics is not None
        self.universe = _topic_qids(topics) if topics is not None else pd.Index([], name="qid")
        self.counts: dict[Any, pd.Series | np.ndarray] = {}
        self.calls = 0
        self.frame_x: Any = None
        self.frame: pd.DataFrame | None = None
        self.positional: bool | None = None
        self.target = math.nan  # the frame of the call closest to it is kept

    def __call__(self, x: Any) -> float:
        out = _quiet_run(self.run, x)
        self.calls += 1
        frame = out if isinstance(out, pd.DataFrame) else None
        if isinstance(out, np.ndarray | list | tuple):
            arr = _positional_counts(out, f"run({x!r})")
            if self.fixed and len(arr) != len(self.universe):
                raise ValueError(
                    f"run({x!r}) returned {len(arr)} positional counts but topics has {len(self.universe)} queries"
                )
            if (arr < 0).any():
                raise ValueError(f"run({x!r}) returned negative counts")
            self._kind(True)
            self.counts[x] = arr
        else:
            try:
                counts = retrieved_counts(out)
            except (TypeError, ValueError) as e:
                raise type(e)(f"run({x!r}): {e}") from e
            self._kind(False)
            if not self.fixed:  # with topics, mean() drops qids outside them and fills the missing with 0
                self.universe = self.universe.union(counts.index)
            self.counts[x] = counts
        if frame is not None:
            if self.frame is None or self._closer(x, self.frame_x):
                self.frame_x, self.frame = x, frame
        return self.mean(x)

    def _kind(self, positional: bool) -> None:
        if self.positional is None:
            self.positional = positional
        elif self.positional != positional:
            raise TypeError("run must return the same kind of answer (frame/Series or array) at every value")

    def mean(self, x: Any) -> float:
        c = self.counts[x]
        if isinstance(c, np.ndarray):
            return float(c.mean()) if len(c) else 0.0
        if len(self.universe) == 0:
            return 0.0
        return float(c.reindex(self.universe, fill_value=0).sum()) / len(self.universe)

    def series(self, x: Any) -> pd.Series | np.ndarray:
        c = self.counts[x]
        return c if isinstance(c, np.ndarray) else c.reindex(self.universe, fill_value=0).astype(np.int64)

    def _closer(self, x: Any, y: Any) -> bool:
        return abs(self.mean(x) - self.target) <= abs(self.mean(y) - self.target)


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
    """Find the parameter value at which a variable-depth retriever retrieves ``target_k`` documents per query
    on average -- the fair-comparison protocol of pEBR Sec. 4.1.3 ("we slightly adjust the threshold so that
    the average number of retrieved items across all queries equals k").

    Monotone bisection on ``[lo, hi]``: with ``increasing=True`` the mean count grows with the parameter (the
    CDF value ``p`` of a CDF cutoff, ``k`` of top-k); with ``increasing=False`` it shrinks (a cosine-score
    threshold). Both ends are evaluated first; a target outside the counts they reach is an error naming the
    reachable range. Each midpoint is checked against its bracket, and a mean that leaves the bracket's range
    raises (the system is not monotone in the parameter).

    Args:
        run: ``x -> answer`` where the answer is a PyTerrier result frame (``qid`` needed), qid-indexed counts
            (Series or ``{qid: count}``), or positional per-query counts (array, same query order each call).
            E.g. ``lambda p: (encoder >> CDFCutoffRetriever(index, p=p)).transform(topics)``.
        target_k: mean documents per query to reach (> 0).
        lo, hi: search bracket, ``lo < hi``.
        increasing: whether the count grows with the parameter.
        rel_tol: success when ``|mean_k - target_k| <= rel_tol * target_k`` (1% by default).
        max_iter: most calls to ``run``, both ends included.
        topics: the query set (frame with ``qid`` or an iterable of qids). A query with no rows counts 0 only
            if it is known: pass ``topics``, else the qids seen in the answers so far are the query set.
        integer: the parameter is an integer (top-k): bisection over integers down to adjacent values, which
            returns the exact ``k`` when some integer reaches ``target_k`` exactly.
        x_tol: stop once the bracket is narrower than this (default ``1e-12 * (hi - lo)``; continuous only):
            a count that jumps over the tolerance band is not chased down to float resolution.

    Returns:
        A :class:`Calibration`; ``achieved`` is ``False`` (and a warning is issued) when the count jumps over
        the tolerance band (e.g. ties in scores) or ``max_iter`` runs out -- ``value`` is then the closest
        value found.

    Raises:
        ValueError: ``target_k <= 0``, ``lo >= hi``, bad ``rel_tol``/``max_iter``, a target outside the
            reachable range, non-monotone counts, or answers without ``qid``.
    """
    if not (isinstance(target_k, int | float | np.integer | np.floating) and math.isfinite(target_k)) or target_k <= 0:
        raise ValueError(f"target_k must be a finite number > 0, got {target_k!r}")
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol!r}")
    if max_iter < 2:
        raise ValueError(f"max_iter must be >= 2 (both ends are evaluated), got {max_iter!r}")
    if integer:
        if int(lo) != lo or int(hi) != hi:
            raise ValueError(f"integer=True needs integral lo and hi, got lo={lo!r}, hi={hi!r}")
        lo, hi = int(lo), int(hi)

    if x_tol is None:
        x_tol = 1e-12 * (hi - lo)
    elif not x_tol >= 0:
        raise ValueError(f"x_tol must be >= 0, got {x_tol!r}")
    target = float(target_k)
    tol = rel_tol * target
    ev = _CountingRun(run, topics)
    ev.target = target
    evaluated: list[Any] = []

    def f(x: Any) -> float:
        evaluated.append(x)
        return ev(x)

    f(lo)
    f(hi)
    a, b = lo, hi
    f_a, f_b = ev.mean(a), ev.mean(b)  # recomputed: the qid universe may have grown at hi
    direction = "increasing" if increasing else "decreasing"
    if (f_b < f_a) if increasing else (f_b > f_a):
        raise ValueError(
            f"mean retrieved count is {f_a:.6g} at lo={lo!r} and {f_b:.6g} at hi={hi!r}, which is not {direction}; "
            f"pass increasing={not increasing}"
        )
    k_min, k_max = min(f_a, f_b), max(f_a, f_b)
    if target < k_min - tol or target > k_max + tol:
        raise ValueError(
            f"target_k={target:g} is unreachable: for x in [{lo!r}, {hi!r}] the mean retrieved count per query "
            f"ranges over [{k_min:.6g}, {k_max:.6g}]; widen [lo, hi]"
        )

    def done(x: Any) -> bool:
        m = ev.mean(x)
        return m == target if integer else abs(m - target) <= tol

    if not (done(a) or done(b)):
        while ev.calls < max_iter:
            if integer:
                if b - a <= 1:
                    break
                mid = (a + b) // 2
            else:
                mid = a + (b - a) / 2
                if b - a <= x_tol or not a < mid < b:  # bracket exhausted
                    break
            f_m = f(mid)
            f_a, f_b = ev.mean(a), ev.mean(b)
            eps = 1e-9 * max(1.0, abs(f_a), abs(f_b))
            low, high = (f_a, f_b) if increasing else (f_b, f_a)
            if f_m < low - eps or f_m > high + eps:
                raise ValueError(
                    "the mean retrieved count is not monotone in the parameter: "
                    f"{f_a:.6g} at x={a!r}, {f_m:.6g} at x={mid!r}, {f_b:.6g} at x={b!r} ({direction} expected)"
                )
            if done(mid):
                break
            if (f_m < target) == increasing:
                a = mid
            else:
                b = mid

    # closest mean; among equals the latest call (the tightest bracket, next to a jump in the count)
    best = min(evaluated, key=lambda x: (abs(ev.mean(x) - target), -evaluated.index(x)))
    mean_k = ev.mean(best)
    achieved = abs(mean_k - target) <= tol
    frame = None
    if ev.frame is not None:
        if ev.frame_x != best:  # the qid universe grew after the frame was kept: fetch it again
            frame = _quiet_run(run, best)
            ev.calls += 1
        else:
            frame = ev.frame
    if not achieved:
        warnings.warn(
            f"calibrate_mean_k: closest mean count {mean_k:.6g} at x={best!r} misses target_k={target:g} by more "
            f"than {rel_tol:.2%} after {ev.calls} runs (the count may jump over the target, e.g. tied scores)",
            RuntimeWarning,
            stacklevel=2,
        )
    return Calibration(
        value=best,
        mean_k=mean_k,
        target_k=target,
        iterations=ev.calls,
        achieved=achieved,
        frame=frame,
        counts=ev.series(best),
        history=[(x, ev.mean(x)) for x in evaluated],
    )


# --------------------------------------------------------------------------------------------------------------
# 2. head / torso / tail strata (Sec. 4.2)
# --------------------------------------------------------------------------------------------------------------


def assign_strata(
    topics: pd.DataFrame | None,
    qrels: pd.DataFrame | None = None,
    popularity_column: str | None = None,
    *,
    min_label: int = 1,
    ties: Literal["group", "split"] = "group",
) -> pd.DataFrame:
    """Split queries into head, torso and tail strata for the stratified evaluation of pEBR Sec. 4.2 (Table 1).

    The paper splits by query popularity (search frequency). When the topics carry a popularity column
    (``popularity_column``, or one of :data:`POPULARITY_COLUMNS`) its terciles are used -- or its labels, if
    it already holds ``head``/``torso``/``tail``; otherwise, since open test collections carry no query
    logs, the proxy is the number of judged-relevant documents per query (label >= ``min_label``): head =
    the third of queries with the most relevant documents (pEBR Sec. 4.2: "head queries normally have many
    more relevant items than tail queries"). Topics missing from ``qrels`` have 0 relevant documents.

    Tercile membership: queries sorted by value, most first; a query at 0-based position ``r`` of ``n`` goes
    to stratum ``floor(3 (r + 1/2) / n)``. Ties are deterministic: ``ties="group"`` (default) gives tied
    queries their average position so equal values always share a stratum (strata may then be unequal or
    even empty -- a warning says so); ``ties="split"`` breaks ties by qid (ascending) for equal thirds.

    Args:
        topics: frame with ``qid`` (plus a popularity column, if any); ``None`` takes the qids of ``qrels``.
        qrels: frame with ``qid, docno, label``; needed when there is no popularity column.
        popularity_column: name of the popularity column to use.
        min_label: smallest label counted as relevant.
        ties: ``"group"`` or ``"split"``, see above.

    Returns:
        Frame with ``qid``, ``stratum`` (categorical head < torso < tail), ``value`` (the popularity or the
        relevant count) and ``basis``: ``"popularity column <name>"`` or
        ``"terciles of the number of relevant documents per query"``; the basis is also in ``.attrs["basis"]``.

    Raises:
        ValueError: no queries, missing columns, an unknown popularity column, NaN popularity, or neither a
            popularity column nor qrels.
    """
    if ties not in ("group", "split"):
        raise ValueError(f"ties must be 'group' or 'split', got {ties!r}")
    if topics is None and qrels is None:
        raise ValueError("assign_strata needs topics or qrels")
    if topics is not None:
        _require_columns(topics, ["qid"], "topics")
    if popularity_column is not None:
        if topics is None or popularity_column not in topics.columns:
            have = [] if topics is None else list(topics.columns)
            raise ValueError(f"popularity column {popularity_column!r} is not in topics (columns: {have})")
    elif topics is not None:
        popularity_column = next((c for c in POPULARITY_COLUMNS if c in topics.columns), None)

    if popularity_column is not None:
        assert topics is not None
        basis = f"popularity column {popularity_column}"
        frame = topics[["qid", popularity_column]].copy()
        frame["qid"] = frame["qid"].astype(str)
        frame = frame.drop_duplicates("qid")
        values = frame[popularity_column]
        if values.isna().any():
            raise ValueError(f"popularity column {popularity_column!r} has missing values")
        labels = values.astype(str).str.lower()
        if not pd.api.types.is_numeric_dtype(values) and labels.isin(STRATA).all():
            out = pd.DataFrame({"qid": frame["qid"].to_numpy(), "stratum": labels.to_numpy(), "value": np.nan})
            return _finish_strata(out, basis)
        try:
            values = pd.to_numeric(values)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"popularity column {popularity_column!r} must be numeric or hold head/torso/tail labels"
            ) from e
        qids, vals = frame["qid"].to_numpy(), values.to_numpy(dtype=float)
    else:
        if qrels is None:
            raise ValueError(
                "no popularity column in topics (looked for "
                f"{list(POPULARITY_COLUMNS)}) and no qrels to count relevant documents from"
            )
        _require_columns(qrels, ["qid", "docno", "label"], "qrels")
        basis = NUM_REL_BASIS
        rel = qrels[qrels["label"] >= min_label]
        num_rel = rel.drop_duplicates(["qid", "docno"])["qid"].astype(str).value_counts()
        qids_idx = _topic_qids(topics) if topics is not None else _topic_qids(qrels)
        num_rel = num_rel.reindex(qids_idx, fill_value=0)
        qids, vals = num_rel.index.to_numpy(), num_rel.to_numpy(dtype=float)

    n = len(qids)
    if n == 0:
        raise ValueError("assign_strata: no queries to stratify")
    if ties == "group":
        pos = pd.Series(vals).rank(method="average", ascending=False).to_numpy() - 1.0
    else:
        order = np.lexsort((qids.astype(str), -vals))  # value descending, then qid ascending
        pos = np.empty(n)
        pos[order] = np.arange(n)
    idx = np.minimum(np.floor(3.0 * (pos + 0.5) / n).astype(int), 2)
    out = pd.DataFrame({"qid": qids.astype(str), "stratum": np.asarray(STRATA, dtype=object)[idx], "value": vals})
    return _finish_strata(out, basis)


def _finish_strata(out: pd.DataFrame, basis: str) -> pd.DataFrame:
    out["stratum"] = pd.Categorical(out["stratum"], categories=list(STRATA), ordered=True)
    out["basis"] = basis
    out = out.sort_values(["stratum", "qid"], kind="stable").reset_index(drop=True)
    out.attrs["basis"] = basis
    empty = [s for s in STRATA if not (out["stratum"] == s).any()]
    if empty:
        warnings.warn(
            f"assign_strata ({basis}): stratum(s) {empty} are empty -- too few queries or too many ties",
            UserWarning,
            stacklevel=3,
        )
    return out


# --------------------------------------------------------------------------------------------------------------
# 3. set measures per stratum (Sec. 4.1.3, Table 1)
# --------------------------------------------------------------------------------------------------------------


def _parse_measures(measures: Sequence[Any] | str | Any) -> list[Any]:
    import ir_measures

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


def _dict_of_dict(qid: pd.Series, docno: pd.Series, value: pd.Series) -> dict[str, dict[str, Any]]:
    """``{qid: {docno: value}}`` for ir_measures, built from numpy arrays (its own frame reader iterates rows)."""
    q = qid.astype(str).to_numpy(dtype=object)
    d = docno.astype(str).to_numpy(dtype=object)
    v = value.to_numpy()
    order = np.argsort(q, kind="stable")
    q, d, v = q[order], d[order], v[order].tolist()
    out: dict[str, dict[str, Any]] = {}
    if len(q) == 0:
        return out
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    ends = np.r_[starts[1:], len(q)]
    for s, e in zip(starts.tolist(), ends.tolist()):
        out[q[s]] = dict(zip(d[s:e].tolist(), v[s:e]))
    return out


def per_query_set_measures(
    runs: Mapping[str, pd.DataFrame],
    qrels: pd.DataFrame,
    strata: StrataLike | None = None,
    measures: Sequence[Any] | str = ("SetR", "SetP"),
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    min_label: int = 1,
) -> pd.DataFrame:
    """Per-query values behind :func:`evaluate_set_measures` (for significance tests or plots).

    The evaluated queries are those with at least one qrel of label >= ``min_label`` (restricted to
    ``topics`` when given). A query a run retrieved nothing for scores 0 on every measure (trec_eval ``-c``)
    and has ``num_retrieved`` 0.

    Returns:
        Frame with ``name, qid, stratum`` (``None`` without strata), ``num_retrieved`` and one column per
        measure (``str(measure)``, e.g. ``SetR``, ``R@1500``), one row per (system, query).
    """
    import ir_measures

    if not isinstance(runs, Mapping) or not runs:
        raise ValueError("runs must be a non-empty mapping of name -> result frame")
    _require_columns(qrels, ["qid", "docno", "label"], "qrels")
    ms = _parse_measures(measures)
    qids = _evaluated_qids(qrels, topics, min_label)
    stratum = pd.Series(None, index=qids, dtype=object)
    if strata is not None:
        s = _strata_series(strata)
        common = qids[qids.isin(s.index)]
        if len(common) == 0:
            raise ValueError("strata share no qid with the evaluated queries (those with relevant documents)")
        stratum.loc[common] = s.loc[common].to_numpy()
        missing = len(qids) - len(common)
        if missing:
            warnings.warn(f"{missing} evaluated queries have no stratum; they count in 'all' only", stacklevel=2)

    q = qrels[qrels["qid"].astype(str).isin(qids)]
    irm_qrels = _dict_of_dict(q["qid"], q["docno"], q["label"].astype(int))
    names = [str(m) for m in ms]
    frames = []
    for name, run in runs.items():
        _require_columns(run, ["qid", "docno"], f"run {name!r}")
        r = run[run["qid"].astype(str).isin(qids)]
        if "score" in r.columns:
            score = r["score"].astype(float)
        elif "rank" in r.columns:
            score = -r["rank"].astype(float)
        else:
            raise ValueError(f"run {name!r} needs a 'score' or 'rank' column; it has {list(run.columns)}")
        irm_run = _dict_of_dict(r["qid"], r["docno"], score)
        values: dict[str, dict[str, float]] = {m: {} for m in names}
        for metric in ir_measures.iter_calc(ms, irm_qrels, irm_run):
            values[str(metric.measure)][str(metric.query_id)] = float(metric.value)
        table = pd.DataFrame({m: pd.Series(v, dtype=float) for m, v in values.items()}, columns=names)
        out = table.reindex(qids).fillna(0.0).reset_index()
        out.insert(0, "name", name)
        out.insert(2, "stratum", stratum.reindex(qids).to_numpy())
        out.insert(3, "num_retrieved", retrieved_counts(r, qids).to_numpy())
        frames.append(out)
    return pd.concat(frames, ignore_index=True)


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
    """Set precision/recall of variable-depth runs, overall and per head/torso/tail stratum -- pEBR Table 1.

    With the depths matched by :func:`calibrate_mean_k` (Sec. 4.1.3), ``SetP``/``SetR`` of a variable-depth
    run are the paper's P@k / R@k at average depth k; any ``ir_measures`` measure works (``"R@1500"``,
    ``"nDCG@10"``, ``ir_measures.SetR(rel=2)``). ``pt.Experiment`` tests whole systems; this gives the
    per-stratum table with paired t-tests (``scipy.stats.ttest_rel`` over the stratum's queries) against
    ``baseline``.

    Args:
        runs: ``{name: result frame}`` (``qid, docno`` and ``score`` or ``rank``), e.g. top-k, score cutoff
            and CDF cutoff runs at matched mean depth.
        qrels: ``qid, docno, label``.
        strata: from :func:`assign_strata` (or a qid -> stratum Series/mapping); ``None`` gives "all" only.
        measures: ``ir_measures`` measures or their names.
        baseline: name in ``runs`` to test the others against (p-value columns).
        topics: restrict the evaluated queries to these.
        min_label: a query is evaluated when it has a qrel with label >= ``min_label``.

    Returns:
        Tidy frame, one row per (system, stratum) with ``stratum`` in ``all, head, torso, tail``:
        ``name, stratum, n_queries, mean_k`` (mean documents retrieved per query, 0 for empty queries), one
        column per measure (mean over the stratum's queries), and with ``baseline`` a ``"<measure> p-value"``
        column per measure (NaN for the baseline itself and where the test is undefined).
    """
    from scipy import stats

    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the runs {list(runs)}")
    per_q = per_query_set_measures(runs, qrels, strata, measures, topics=topics, min_label=min_label)
    names = [str(m) for m in _parse_measures(measures)]
    groups: list[tuple[str, pd.Series]] = [("all", pd.Series(True, index=per_q.index))]
    if strata is not None:
        for s in _stratum_order(per_q["stratum"].dropna()):
            groups.append((s, per_q["stratum"] == s))
    rows = []
    for name in runs:
        mine = per_q["name"] == name
        for label, in_group in groups:
            sel = per_q[mine & in_group].set_index("qid")
            row: dict[str, Any] = {
                "name": name,
                "stratum": label,
                "n_queries": len(sel),
                "mean_k": float(sel["num_retrieved"].mean()),
            }
            for m in names:
                row[m] = float(sel[m].mean())
            if baseline is not None:
                base = per_q[(per_q["name"] == baseline) & in_group].set_index("qid")
                for m in names:
                    p = math.nan
                    if name != baseline and len(sel) >= 2:
                        x, y = sel[m], base[m].reindex(sel.index)
                        if not np.allclose(x.to_numpy() - y.to_numpy(), 0.0):
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore", RuntimeWarning)
                                p = float(stats.ttest_rel(x.to_numpy(), y.to_numpy()).pvalue)
                    row[f"{m} p-value"] = p
            rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------------------
# 4. Table 3: mean retrieved count per stratum against the CDF value (Sec. 4.4.2)
# --------------------------------------------------------------------------------------------------------------


def table3_grid(
    run_for_p: Callable[[float], Counts],
    ps: Sequence[float] = TABLE3_PS,
    strata: StrataLike | None = None,
    *,
    topics: pd.DataFrame | Iterable[str] | None = None,
    include_all: bool = False,
) -> pd.DataFrame:
    """Average number of retrieved documents per stratum for each CDF value -- pEBR Table 3 (Sec. 4.4.2).

    Args:
        run_for_p: ``p -> answer``: a result frame (``qid``), qid-indexed counts (Series or mapping), or a
            positional counts array in the order of ``strata`` (or ``topics``).
        ps: the cutoff CDF values (columns), default the paper's 0.99 ... 0.4.
        strata: from :func:`assign_strata`; a query with no rows counts 0 in its stratum. ``None`` gives a
            single ``all`` row over ``topics`` (or the qids seen).
        topics: the query set when ``strata`` is ``None``.
        include_all: add an ``all`` row (mean over every stratified query).

    Returns:
        Frame with rows ``head, torso, tail`` (index ``stratum``, present strata only) and columns ``p``.
    """
    ps = list(ps)
    if not ps:
        raise ValueError("ps is empty")
    if strata is not None:
        s = _strata_series(strata)
        qids = s.index
    else:
        s = None
        qids = _topic_qids(topics) if topics is not None else None
    cols: dict[float, pd.Series] = {}
    for p in ps:
        out = _quiet_run(run_for_p, p)  # a sweep: its low levels may retrieve nothing by design
        if isinstance(out, np.ndarray | list | tuple):
            arr = _positional_counts(out, f"run_for_p({p!r})")
            if qids is None or len(arr) != len(qids):
                raise ValueError(
                    f"run_for_p({p!r}) returned {len(arr)} positional counts; positional counts need strata or "
                    f"topics of the same length ({'none given' if qids is None else len(qids)})"
                )
            cols[p] = pd.Series(arr, index=qids)
        else:
            try:
                cols[p] = retrieved_counts(out, qids)
            except (TypeError, ValueError) as e:
                raise type(e)(f"run_for_p({p!r}): {e}") from e
    if s is None:
        universe = pd.Index(sorted(set().union(*(c.index for c in cols.values()))), name="qid")
        counts = pd.DataFrame({p: c.reindex(universe, fill_value=0) for p, c in cols.items()})
        table = counts.mean().to_frame("all").T
    else:
        counts = pd.DataFrame(cols).reindex(s.index, fill_value=0)
        table = counts.groupby(s.to_numpy(), sort=False).mean()
        table = table.loc[_stratum_order(table.index)]
        if include_all:
            table.loc["all"] = counts.mean()
    table.index.name = "stratum"
    table.columns = pd.Index(ps, name="p")
    return table.astype(float)
