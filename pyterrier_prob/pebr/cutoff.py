"""Variable-depth dense retrieval: pEBR's CDF cutoff and the DSSM-score / DSSM-topk baselines.

pEBR (``shared/papers/pebr.md``) compares three ways of cutting off the items a two-tower model retrieves
(Sec. 4.1.2); Appendix A writes the classic ones as ``S_{t,K}(q) = Top_K({d : cos(q, d) >= t})``:

* **DSSM-topk** (:class:`TopKRetriever`): a fixed number K of items per query (t = -inf);
* **DSSM-score** (:class:`ScoreCutoffRetriever`): a fixed cosine threshold t, with K as the cap that
  "is mainly to save inference cost" (Appendix A);
* **pEBR** (:class:`CDFCutoffRetriever`): a per-query threshold ``t_q = F_q^{-1}(1 - p)`` read off the CDF
  of the query's learned relevant-item law (default p = 0.5, Sec. 4.1.2), so that a share p of that law lies
  above it -- broad (head) queries get low thresholds and many items, narrow (tail) queries few (Sec. 4.2).
  The law is the 1-D one of Sec. 3.2 (``dim=None``) or Appendix A's sphere-corrected one (``dim=n``), from
  :mod:`st_extensions.distributions`, with the per-query parameters read from the input frame
  (``query_temp``, or ``query_alpha``/``query_beta``), as :class:`~pyterrier_prob.ProbBiEncoder` writes them.

All three are one algorithm with per-query thresholds t_q (-inf for top-k) and cap K (``num_results``):
keep every document with ``cos(q, d) >= t_q``, then the K highest among them. Because the kept set of a
cosine threshold is always a head of the cosine ranking, this equals the top-K ranking truncated at t_q.
The search is exact and exhaustive (:func:`threshold_search`): per query block and document chunk one BLAS
``Q_b @ D_c^T``, a vectorised ``>= t_q`` mask (in threads), and -- with a cap -- each query's threshold raised
to the K-th best score seen so far (a lower bound of its final K-th best), so that later chunks keep few
candidates. No Python loop runs over documents. Scores are cosines: query vectors are L2-normalised here, and
index vectors are normalised at indexing (:class:`~pyterrier_prob.DenseIndex`) or, for a FlexIndex holding
unnormalised vectors, divided by their norms on the fly.

Every retriever works as a first stage (input: a query frame with ``query_vec``) and as a re-ranker of a
candidate frame (input with ``docno``: only each query's candidates are scored, their vectors looked up by
docno), supports ``retriever % k`` (:meth:`fuse_rank_cutoff`) and returns ``qid, docno, score, rank`` (rank
from 0, as :func:`pyterrier.model.add_ranks` assigns it) plus the input columns; first-stage output also
has ``docid`` (the row in the index), as pyterrier-dr's retrievers do.

Repeated qids: a query frame that lists a qid on several rows with the same ``query_vec`` (and distribution
parameters) is retrieved once per qid -- the first row's columns are kept, so no (qid, docno) appears twice and each
qid has one rank 0; rows of one qid with different values (in a query frame or a candidate frame) raise a ValueError
naming the qid, the two rows and the column. Missing qids / docnos and vectors that are missing, textual (after a CSV
round trip) or non-finite raise a ValueError naming the column and the row.

Relation to pyterrier-dr: ``FlexIndex.np_retriever(num_results=K)`` / ``faiss_flat_retriever`` on the same
index return the same top-K as :class:`TopKRetriever` (up to float rounding and ties; they score by inner
product, which is the cosine on a normalised :class:`~pyterrier_prob.DenseIndex`). :class:`TopKRetriever`
exists so that the three cutoffs share one implementation, one output schema and one cost profile.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.index.dense import DenseIndex, as_dense_index
from pyterrier_prob.pebr.encoders import PARAM_COLUMNS
from pyterrier_prob.validation import (
    check_ids,
    check_rows_match_query,
    check_same_per_query,
    first_rows,
    float_column,
    row_namer,
    stack_arrays,
)
from st_extensions.distributions import BetaCosine, ExpCosine

__all__ = [
    "CDFCutoffRetriever",
    "CutoffHits",
    "ScoreCutoffRetriever",
    "TopKRetriever",
    "count_above",
    "threshold_search",
]

QUERY_BATCH = 1024  # queries per block
DOC_BATCH = 16384  # documents per chunk: a block's score matrix is QUERY_BATCH x DOC_BATCH float32 (64 MiB)
_RERANK_ROWS = 65536  # candidate rows scored at once in re-ranking mode
_PARALLEL_MIN = 1 << 20  # score matrices smaller than this are masked in one thread
_PRUNE_MIN = 1 << 22  # candidates kept across chunks before pruning to each query's best k ...
_PRUNE_FACTOR = 8  # ... and at least _PRUNE_FACTOR * k per query of the block


# --------------------------------------------------------------------------------------------------------
# the search
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CutoffHits:
    """What :func:`threshold_search` found, in CSR form.

    Query i's hits are ``docids[offsets[i]:offsets[i+1]]`` (rows of the index) with cosine ``scores`` in the
    same slice, sorted by score, descending (ties: lower docid first).
    """

    offsets: np.ndarray  # (Q + 1,) int64
    docids: np.ndarray  # (total,) int64
    scores: np.ndarray  # (total,) float32

    @property
    def counts(self) -> np.ndarray:
        """Number of hits per query."""
        return np.diff(self.offsets)


def _n_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


def _f32_ceil(t: np.ndarray) -> np.ndarray:
    """The smallest float32 >= t, elementwise: for float32 scores s, ``s >= result`` iff ``s >= t``."""
    t = np.asarray(t, dtype=np.float64)
    t32 = t.astype(np.float32)
    up = t32.astype(np.float64) < t
    if up.any():
        t32[up] = np.nextafter(t32[up], np.float32(np.inf))
    return t32


def _check_num_results(num_results: Any, allow_none: bool) -> int | None:
    if num_results is None and allow_none:
        return None
    if isinstance(num_results, bool) or not isinstance(num_results, numbers.Integral) or num_results < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"num_results must be {allowed}, got {num_results!r}")
    return int(num_results)


def _query_matrix(vecs: Sequence[Any] | np.ndarray, dim: int) -> np.ndarray:
    """Stack query vectors into a C-contiguous float32 (Q, dim) matrix of unit rows (checked)."""
    if isinstance(vecs, np.ndarray) and vecs.ndim == 2:
        mat = np.asarray(vecs, dtype=np.float32)
    else:
        rows = [np.asarray(v, dtype=np.float32) for v in vecs]
        if not rows:
            return np.zeros((0, dim), np.float32)
        shapes = {r.shape for r in rows}
        if len(shapes) != 1 or rows[0].ndim != 1:
            raise ValueError(f"query_vec must hold 1-D vectors of one length, got shapes {sorted(shapes)[:3]}")
        mat = np.stack(rows)
    if mat.ndim != 2:
        raise ValueError(f"query vectors must have shape (queries, dim), got {mat.shape}")
    return _unit_rows(mat, dim, lambda i: f"row {i}")


def _unit_rows(mat: np.ndarray, dim: int, name: Any) -> np.ndarray:
    """``mat`` (queries, dim) checked against the index's dimension and L2-normalised (float32, C-contiguous)."""
    if mat.shape[1] != dim:
        raise ValueError(
            f"dimension mismatch: query_vec has {mat.shape[1]} dims but the index holds {dim}-dim vectors "
            "(were queries and documents encoded by the same model?)"
        )
    norms = np.linalg.norm(mat.astype(np.float64), axis=1)
    if not np.all(np.isfinite(norms)):
        i = int(np.flatnonzero(~np.isfinite(norms))[0])
        raise ValueError(f"query_vec of {name(i)} has non-finite values (nan or inf)")
    if np.any(norms == 0):
        i = int(np.flatnonzero(norms == 0)[0])
        raise ValueError(f"query_vec of {name(i)} is an all-zero vector: its cosine with any document is undefined")
    return np.ascontiguousarray(mat / norms[:, None], dtype=np.float32)


def _doc_scale(index: DenseIndex) -> np.ndarray | None:
    """``1 / ||d||`` per document when the index's vectors are not unit-norm (None when they are)."""
    if index.normalized:
        return None
    key = "pyterrier_prob.doc_scale"
    if key not in index._cache:
        vecs = index.vectors()
        norms = np.concatenate(
            [
                np.linalg.norm(np.asarray(vecs[i : i + DOC_BATCH], np.float64), axis=1)
                for i in range(0, len(vecs), DOC_BATCH)
            ]
        )
        if np.allclose(norms, 1.0, rtol=0, atol=1e-4):
            index._cache[key] = None
        else:
            with np.errstate(divide="ignore"):
                index._cache[key] = np.where(norms > 0, 1.0 / norms, 0.0).astype(np.float32)
    return index._cache[key]


def _docnos_of(index: DenseIndex, docids: np.ndarray) -> np.ndarray:
    """Docnos (object array) of index rows; many lookups go through a cached array of all docnos."""
    if not docids.size:
        return np.zeros(0, dtype=object)
    key = "pyterrier_prob.docnos"
    if key not in index._cache and docids.size >= len(index) // 4:
        index._cache[key] = np.asarray(index.docno_array(), dtype=object)
    if key in index._cache:
        return index._cache[key][docids]
    uniq, inv = np.unique(docids, return_inverse=True)
    return np.asarray(index.docnos().fwd[uniq], dtype=object)[inv.reshape(-1)]


def _check_thresholds(thresholds: Any, n: int) -> np.ndarray:
    t = np.asarray(thresholds, dtype=np.float64).reshape(-1)
    if t.size == 1 and n != 1:
        t = np.full(n, t[0])
    if t.shape != (n,):
        raise ValueError(f"thresholds must be a scalar or one per query ({n}), got shape {np.shape(thresholds)}")
    if np.isnan(t).any():
        raise ValueError("thresholds must not be nan")
    return t


class _Masker:
    """``flatnonzero(S >= t[:, None])``, split over row slices in threads for large score matrices."""

    def __init__(self) -> None:
        self.n = _n_threads()
        self.pool = ThreadPoolExecutor(self.n) if self.n > 1 else None

    def __enter__(self) -> _Masker:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    def above(self, S: np.ndarray, t: np.ndarray) -> np.ndarray:
        if self.pool is None or S.size < _PARALLEL_MIN or S.shape[0] < 2:
            return np.flatnonzero(S >= t[:, None])
        C = S.shape[1]
        bounds = np.linspace(0, S.shape[0], min(self.n, S.shape[0]) + 1).astype(int)

        def part(i: int) -> np.ndarray:
            r0, r1 = bounds[i], bounds[i + 1]
            return np.flatnonzero(S[r0:r1] >= t[r0:r1, None]) + r0 * C

        return np.concatenate(list(self.pool.map(part, range(len(bounds) - 1))))

    def count(self, S: np.ndarray, t: np.ndarray) -> np.ndarray:
        if self.pool is None or S.size < _PARALLEL_MIN or S.shape[0] < 2:
            return np.count_nonzero(S >= t[:, None], axis=1)
        bounds = np.linspace(0, S.shape[0], min(self.n, S.shape[0]) + 1).astype(int)

        def part(i: int) -> np.ndarray:
            r0, r1 = bounds[i], bounds[i + 1]
            return np.count_nonzero(S[r0:r1] >= t[r0:r1, None], axis=1)

        return np.concatenate(list(self.pool.map(part, range(len(bounds) - 1))))


def _scores(Qb: np.ndarray, vecs: np.ndarray, scale: np.ndarray | None, c0: int, c1: int) -> np.ndarray:
    S = Qb @ np.asarray(vecs[c0:c1]).T
    if scale is not None:
        S *= scale[c0:c1]
    return S


def _group(qi: np.ndarray, B: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable order of candidates by query, and each query's [start, end) in that order."""
    order = np.argsort(qi, kind="stable")
    ends = np.cumsum(np.bincount(qi, minlength=B))
    return order, ends


def _raise_to_kth(sc: np.ndarray, qi: np.ndarray, eff: np.ndarray, k: int, grouped: bool) -> None:
    """For every query with more than k candidates, raise eff[q] to the k-th best candidate score."""
    B = eff.shape[0]
    counts = np.bincount(qi, minlength=B)
    over = np.flatnonzero(counts > k)
    if not over.size:
        return
    if grouped:  # candidates already sorted by query
        order, ends = None, np.cumsum(counts)
    else:
        order, ends = _group(qi, B)
    starts = ends - counts
    for q in over:
        seg = sc[starts[q] : ends[q]] if order is None else sc[order[starts[q] : ends[q]]]
        kth = np.partition(seg, seg.size - k)[seg.size - k]
        if kth > eff[q]:
            eff[q] = kth


def _search_block(
    Qb: np.ndarray,
    eff: np.ndarray,
    vecs: np.ndarray,
    scale: np.ndarray | None,
    k: int | None,
    doc_batch: int,
    masker: _Masker,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hits of one query block: (query-in-block, docid, score) arrays, grouped by query, sorted by score."""
    B, N = Qb.shape[0], vecs.shape[0]
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    total = 0
    budget = max(_PRUNE_FACTOR * B * k, _PRUNE_MIN) if k is not None else None
    for c0 in range(0, N, doc_batch):
        c1 = min(N, c0 + doc_batch)
        C = c1 - c0
        S = _scores(Qb, vecs, scale, c0, c1)
        if k is not None and c0 == 0 and C > k:
            # first chunk: queries keeping more than k here start from their k-th best score in the chunk
            rows = np.flatnonzero(masker.count(S, eff) > k)
            if rows.size:
                kth = np.partition(S[rows], C - k, axis=1)[:, C - k]
                eff[rows] = np.maximum(eff[rows], kth)
        flat = masker.above(S, eff)
        qi = flat // C
        sc = S.reshape(-1)[flat]
        di = flat - qi * C + c0
        if k is not None and flat.size > k:
            # the k-th best score of a query in this chunk bounds its final k-th best from below
            _raise_to_kth(sc, qi, eff, k, grouped=True)
            keep = sc >= eff[qi]
            qi, di, sc = qi[keep], di[keep], sc[keep]
        parts.append((qi, di, sc))
        total += qi.size
        if budget is not None and total > budget and len(parts) > 1:  # prune across chunks
            qi, di, sc = (np.concatenate(x) for x in zip(*parts))
            _raise_to_kth(sc, qi, eff, k, grouped=False)
            keep = sc >= eff[qi]
            parts = [(qi[keep], di[keep], sc[keep])]
            total = parts[0][0].size
    if not parts:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.float32)
    qi, di, sc = (np.concatenate(x) for x in zip(*parts)) if len(parts) > 1 else parts[0]
    order, ends = _group(qi, B)
    qi, di, sc = qi[order], di[order], sc[order]
    starts = np.concatenate([[0], ends[:-1]])
    out_q, out_d, out_s = [], [], []
    for q in range(B):
        a, b = starts[q], ends[q]
        if a == b:
            continue
        s, d = sc[a:b], di[a:b]
        if k is not None and s.size > k:  # the k best and everything tied with the k-th
            sel = np.flatnonzero(s >= np.partition(s, s.size - k)[s.size - k])
            s, d = s[sel], d[sel]
        o = np.lexsort((d, -s))[:k]  # by score, ties: lower docid first
        out_s.append(s[o])
        out_d.append(d[o])
        out_q.append(np.full(o.size, q, np.int64))
    if not out_q:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.float32)
    return np.concatenate(out_q), np.concatenate(out_d), np.concatenate(out_s)


def _search_matrix(
    index: DenseIndex,
    Q: np.ndarray,
    thresholds: np.ndarray,
    num_results: int | None,
    batch_size: int,
    doc_batch_size: int,
    verbose: bool,
) -> CutoffHits:
    index.check_finite()  # once per opened index: a corrupt vectors file raises, naming it, instead of matching nothing
    vecs, scale = index.vectors(), _doc_scale(index)
    t32 = _f32_ceil(thresholds)
    n = Q.shape[0]
    counts = np.zeros(n, np.int64)
    all_d, all_s = [], []
    blocks = range(0, n, batch_size)
    if verbose and len(blocks) > 1:
        blocks = pt.tqdm(blocks, desc="cutoff retrieval", unit="qblock")
    with _Masker() as masker:
        for q0 in blocks:
            q1 = min(n, q0 + batch_size)
            qi, di, sc = _search_block(Q[q0:q1], t32[q0:q1].copy(), vecs, scale, num_results, doc_batch_size, masker)
            counts[q0:q1] = np.bincount(qi, minlength=q1 - q0)
            all_d.append(di)
            all_s.append(sc)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    docids = np.concatenate(all_d).astype(np.int64) if all_d else np.zeros(0, np.int64)
    scores = np.concatenate(all_s).astype(np.float32) if all_s else np.zeros(0, np.float32)
    return CutoffHits(offsets, docids, scores)


def threshold_search(
    index: Any,
    query_vecs: np.ndarray | Sequence[np.ndarray],
    thresholds: float | np.ndarray,
    num_results: int | None = None,
    *,
    batch_size: int = QUERY_BATCH,
    doc_batch_size: int = DOC_BATCH,
    verbose: bool = False,
) -> CutoffHits:
    """Exact ``Top_K({d : cos(q, d) >= t_q})`` for every query (pEBR Appendix A's ``S_{t,K}``, per-query t).

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
        query_vecs: ``(Q, dim)`` query vectors (normalised here).
        thresholds: one cosine threshold per query (or a scalar); ``-inf`` keeps everything (top-K).
        num_results: the cap K (``None``: no cap).
        batch_size: queries per block; doc_batch_size: documents per chunk.

    Returns:
        :class:`CutoffHits` -- per query, the kept docids and cosines, best first.
    """
    index = as_dense_index(index)
    Q = _query_matrix(query_vecs, index.dim)
    t = _check_thresholds(thresholds, Q.shape[0])
    k = _check_num_results(num_results, allow_none=True)
    return _search_matrix(index, Q, t, k, int(batch_size), int(doc_batch_size), verbose)


def count_above(
    index: Any,
    query_vecs: np.ndarray | Sequence[np.ndarray],
    thresholds: float | np.ndarray,
    *,
    batch_size: int = QUERY_BATCH,
    doc_batch_size: int = DOC_BATCH,
) -> np.ndarray:
    """Number of documents with ``cos(q, d) >= t_q`` per query (uncapped), without materialising the hits.

    Useful to calibrate thresholds, e.g. to match an average depth k across methods (Sec. 4.1.3).

    Returns:
        ``(Q,)`` int64 counts.
    """
    index = as_dense_index(index)
    Q = _query_matrix(query_vecs, index.dim)
    t32 = _f32_ceil(_check_thresholds(thresholds, Q.shape[0]))
    index.check_finite()
    vecs, scale = index.vectors(), _doc_scale(index)
    counts = np.zeros(Q.shape[0], np.int64)
    with _Masker() as masker:
        for q0 in range(0, Q.shape[0], batch_size):
            q1 = min(Q.shape[0], q0 + batch_size)
            for c0 in range(0, vecs.shape[0], doc_batch_size):
                c1 = min(vecs.shape[0], c0 + doc_batch_size)
                counts[q0:q1] += masker.count(_scores(Q[q0:q1], vecs, scale, c0, c1), t32[q0:q1])
    return counts


# --------------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------------


class _CutoffRetriever(pt.Transformer):
    """Shared machinery: input validation, first-stage and re-ranking modes, output frames, ``%``."""

    _needs_cap = False

    def __init__(
        self,
        index: Any,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
    ) -> None:
        self.index = as_dense_index(index)
        self.num_results = _check_num_results(num_results, allow_none=not self._needs_cap)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = int(batch_size)
        self.drop_query_vec = bool(drop_query_vec)
        self.verbose = bool(verbose)

    # ---- to implement ----------------------------------------------------------------------------------------
    def _columns(self) -> list[str]:
        """Input columns needed besides qid (and docno when re-ranking)."""
        return ["query_vec"]

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        """One cosine threshold per row of ``queries`` (float64)."""
        raise NotImplementedError

    def _hint(self) -> str:
        return "add query vectors with an encoder, e.g. ProbBiEncoder(model).query_encoder() >> retriever"

    def _params(self) -> str:
        raise NotImplementedError

    # ---- shared --------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.index!r}, {self._params()}num_results={self.num_results})"

    def fuse_rank_cutoff(self, k: int) -> _CutoffRetriever:
        """``retriever % k``: the same retriever with ``num_results = min(k, num_results)``."""
        k = _check_num_results(k, allow_none=False)
        out = copy.copy(self)
        out.num_results = k if self.num_results is None else min(k, self.num_results)
        return out

    def subtransformers(self) -> dict:
        return {}

    def _validate(self, inp: pd.DataFrame) -> bool:
        """Validate the input columns; True for re-ranking mode (input has docno), False for first stage."""
        cols = self._columns()
        try:
            with pt.validate.any(inp) as v:
                v.query_frame(extra_columns=cols, mode="retrieve")
                v.result_frame(extra_columns=cols, mode="rerank")
        except pt.validate.InputValidationError as e:
            missing = sorted({c for m in e.modes for c in m.missing_columns if c != "docno"})
            raise pt.validate.InputValidationError(
                f"{type(self).__name__} needs columns {['qid', *cols]} (plus docno to re-rank); missing "
                f"{missing}: {self._hint()}.",
                e.modes,
            ) from e
        return v.mode == "rerank"

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        rerank = self._validate(inp)
        inp = inp.reset_index(drop=True)
        check_ids(inp, ["qid", "docno"] if rerank else ["qid"], type(self).__name__)
        if rerank:
            out = self._rerank(inp)
        else:
            out = self._retrieve(inp)
        if self.drop_query_vec and "query_vec" in out.columns:
            out = out.drop(columns="query_vec")
        return out

    def _retrieve(self, inp: pd.DataFrame) -> pd.DataFrame:
        if not len(inp):
            return inp.assign(
                docno=pd.Series(dtype=object),
                docid=pd.Series(dtype=np.int64),
                score=pd.Series(dtype=np.float32),
                rank=pd.Series(dtype=np.int64),
            )
        inp = self._one_row_per_query(inp)
        Q = self._query_vectors(inp)
        t = self._thresholds(inp)
        hits = _search_matrix(self.index, Q, t, self.num_results, self.batch_size, DOC_BATCH, self.verbose)
        counts = hits.counts
        total = int(hits.offsets[-1])
        out = inp.iloc[np.repeat(np.arange(len(inp)), counts)].reset_index(drop=True)
        return out.assign(
            docno=_docnos_of(self.index, hits.docids),
            docid=hits.docids,
            score=hits.scores,
            rank=np.arange(total, dtype=np.int64) - np.repeat(hits.offsets[:-1], counts),
        )

    # ---- the query side of the input frame -------------------------------------------------------------------
    def _param_columns(self) -> list[str]:
        """Columns besides ``query_vec`` that the thresholds are computed from."""
        return [c for c in self._columns() if c != "query_vec"]

    def _raw_query_vectors(self, inp: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
        """``query_vec`` of ``rows`` (all by default) stacked as float32, with errors naming the row and qid."""
        values = inp["query_vec"].to_numpy()
        name = row_namer(inp)
        if rows is not None:
            values = values[rows]
            name = (lambda n, r: lambda i: n(int(r[i])))(name, rows)
        return stack_arrays(values, "query_vec", name, type(self).__name__, ndim=1)

    def _query_vectors(self, inp: pd.DataFrame) -> np.ndarray:
        """The unit query vectors of a frame with one row per query."""
        return _unit_rows(self._raw_query_vectors(inp), self.index.dim, row_namer(inp))

    def _check_query_rows(self, inp: pd.DataFrame, codes: np.ndarray, first: np.ndarray, raw: np.ndarray) -> None:
        """Every row of a qid carries its first row's ``query_vec`` (``raw``, one per query) and parameters."""
        owner = type(self).__name__
        params = {col: float_column(inp, col, owner) for col in self._param_columns()}  # missing / non-numeric
        check_rows_match_query(inp, codes, first, "query_vec", raw, owner)
        rest = np.flatnonzero(first[codes] != np.arange(len(codes)))
        for col, vals in params.items():
            check_same_per_query(inp, codes, first, col, vals[rest], vals[first], owner, rows=rest)

    def _one_row_per_query(self, inp: pd.DataFrame) -> pd.DataFrame:
        """A query frame with each qid once (its first row); repeated qids must repeat their query exactly."""
        codes, first = first_rows(inp["qid"])
        if len(first) == len(inp):
            return inp
        self._check_query_rows(inp, codes, first, self._raw_query_vectors(inp, first))
        return inp.iloc[first].reset_index(drop=True)

    def _rerank(self, inp: pd.DataFrame) -> pd.DataFrame:
        base = inp.drop(columns=[c for c in ("score", "rank") if c in inp.columns])
        if not len(inp):
            return base.assign(score=pd.Series(dtype=np.float32), rank=pd.Series(dtype=np.int64))
        codes, first = first_rows(inp["qid"])
        n_q = len(first)
        raw = self._raw_query_vectors(inp, first)
        self._check_query_rows(inp, codes, first, raw)
        Q = _unit_rows(raw, self.index.dim, lambda i: row_namer(inp)(int(first[i])))
        t32 = _f32_ceil(self._thresholds(inp.iloc[first].reset_index(drop=True)))

        docids = np.asarray(self.index.docnos().inv[inp["docno"].to_numpy(dtype=str)], dtype=np.int64)
        if (docids < 0).any():
            bad = inp["docno"].to_numpy()[docids < 0]
            raise ValueError(
                f"{int((docids < 0).sum())} candidate docno(s) are not in {self.index!r} (e.g. {list(bad[:3])}): "
                "re-ranking needs the candidates' vectors in the index"
            )
        vecs, scale = self.index.vectors(), _doc_scale(self.index)
        scores = np.empty(len(inp), np.float32)
        for r0 in range(0, len(inp), _RERANK_ROWS):
            r1 = min(len(inp), r0 + _RERANK_ROWS)
            d = docids[r0:r1]
            s = np.einsum("ij,ij->i", Q[codes[r0:r1]], np.asarray(vecs[d]))
            scores[r0:r1] = s if scale is None else s * scale[d]
        if not np.isfinite(scores).all():  # the query vectors are finite: a candidate's stored vector is not
            d = int(docids[np.flatnonzero(~np.isfinite(scores))[0]])
            raise ValueError(
                f"{str(self.index.index_path / 'vecs.f4')!r} is corrupt: the vector of row {d} (docno "
                f"{str(self.index.docnos().fwd[d])!r}) has non-finite values (nan or inf); rebuild the index"
            )

        keep = np.flatnonzero(scores >= t32[codes])
        order = np.lexsort((-scores[keep], codes[keep]))  # stable: ties keep the input order
        sel = keep[order]
        c = codes[sel]
        ends = np.cumsum(np.bincount(c, minlength=n_q))
        rank = np.arange(sel.size, dtype=np.int64) - (ends - np.bincount(c, minlength=n_q))[c]
        if self.num_results is not None:
            m = rank < self.num_results
            sel, rank = sel[m], rank[m]
        return base.iloc[sel].reset_index(drop=True).assign(score=scores[sel], rank=rank)


class CDFCutoffRetriever(_CutoffRetriever):
    """pEBR's probabilistic cutoff (Sec. 4.1.2 "pEBR", Appendix A): keep ``cos(q, d) >= t_q = F_q^{-1}(1 - p)``.

    F_q is the query's learned law of the cosine of its relevant items, built from the per-query parameters
    in the input frame (written by :meth:`ProbBiEncoder.query_encoder`):

    * ``family="beta"`` (BetaNCE, the paper's default): ``query_temp``; Beta law alpha = 1 / tau_q, beta = 1
      (Eq. 3);
    * ``family="exp"`` (ExpNCE, Sec. 3.2.1): ``query_temp``; truncated exponential law with temperature tau_q;
    * ``family="beta_mle"`` (Sec. 3.1): ``query_alpha``, ``query_beta`` (the relevant-item Beta law).

    A share p of the relevant-item law lies above t_q (default p = 0.5, Sec. 4.1.2); larger p, lower
    thresholds, deeper lists. Each query gets its own depth, capped at ``num_results`` (the highest-scoring
    kept documents; ``None``: no cap).

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
        p: share of the relevant-item law to keep, strictly inside (0, 1).
        family: ``"beta"``, ``"exp"`` or ``"beta_mle"`` -- the family of the encoder's head.
        dim: ``None`` for the 1-D law of Sec. 3.2; the embedding dimension n for Appendix A's sphere-corrected
            law (Eq. 4).
        num_results: cap per query.
        batch_size: queries per search block.
        drop_query_vec: drop ``query_vec`` from the output.
        verbose: progress bar over query blocks.

    Example::

        pipeline = encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.5, family=encoder.family)
        rerank = bm25 % 1000 >> encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.9)
    """

    def __init__(
        self,
        index: Any,
        p: float = 0.5,
        family: str = "beta",
        dim: int | None = None,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose)
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < float(p) < 1.0):
            raise ValueError(f"p must be a number strictly inside (0, 1) (the share of the law kept), got {p!r}")
        if family not in PARAM_COLUMNS:
            raise ValueError(f"family must be one of {tuple(PARAM_COLUMNS)}, got {family!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2):
            raise ValueError(f"dim must be None or the embedding dimension (an int >= 2), got {dim!r}")
        self.p = float(p)
        self.family = family
        self.dim = None if dim is None else int(dim)
        if self.index.index_path.exists():
            self._check_dim()

    def _check_dim(self) -> None:
        """The sphere-corrected law's ``dim`` is the index's vector dimension."""
        if self.dim is not None and self.dim != self.index.dim:
            raise ValueError(
                f"dim={self.dim} (the sphere-corrected law's embedding dimension, Appendix A) differs from the "
                f"{self.index.dim}-dim vectors of {self.index!r}: pass dim={self.index.dim} (or None for the 1-D law)"
            )

    def _columns(self) -> list[str]:
        params = PARAM_COLUMNS[self.family][:2] if self.family == "beta_mle" else PARAM_COLUMNS[self.family]
        return ["query_vec", *params]

    def _hint(self) -> str:
        return (
            f"the {self.family!r} cutoff reads each query's distribution parameters from the frame; encode the "
            f"queries with ProbBiEncoder(model).query_encoder() where model has a {self.family!r} "
            "QueryDistributionHead (st_extensions.build_pebr_model(..., family=...))"
        )

    def _params(self) -> str:
        return f"p={self.p}, family={self.family!r}, dim={self.dim}, "

    def distribution(self, queries: pd.DataFrame) -> ExpCosine | BetaCosine:
        """The per-query relevant-item laws of the rows of ``queries``."""
        self._check_dim()
        cols = self._columns()[1:]
        values = [float_column(queries, c, type(self).__name__) for c in cols]
        try:
            if self.family == "exp":
                return ExpCosine(values[0], dim=self.dim)
            if self.family == "beta":
                return BetaCosine.from_temperature(values[0], dim=self.dim)
            return BetaCosine(values[0], values[1], dim=self.dim)
        except ValueError as e:
            raise ValueError(f"bad distribution parameters in columns {cols}: {e}") from e

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.asarray(self.distribution(queries).cutoff(self.p), dtype=np.float64).reshape(-1)


class ScoreCutoffRetriever(_CutoffRetriever):
    """DSSM-score (Sec. 4.1.2): keep ``cos(q, d) >= threshold``, one threshold for all queries, capped at K.

    Appendix A's ``S_{t,K}`` with a fixed t: "the cosine threshold does not account for the variability of item
    distributions across different queries, while the top-K threshold is mainly to save inference cost".

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
        threshold: the cosine threshold (finite).
        num_results: the cap K (``None``: no cap).
    """

    def __init__(
        self,
        index: Any,
        threshold: float,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose)
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number (a cosine), got {threshold!r}")
        self.threshold = float(threshold)

    def _params(self) -> str:
        return f"threshold={self.threshold}, "

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), self.threshold)


class TopKRetriever(_CutoffRetriever):
    """DSSM-topk (Sec. 4.1.2): the ``num_results`` documents of highest cosine for every query.

    Same ranking as pyterrier-dr's ``FlexIndex.np_retriever(num_results=K)`` on a normalised index; this
    class shares the cutoff retrievers' implementation and output schema.
    """

    _needs_cap = True

    def __init__(
        self,
        index: Any,
        num_results: int = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose)

    def _params(self) -> str:
        return ""

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), -np.inf)
