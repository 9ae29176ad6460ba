"""The exact, exhaustive search of a dense index: ``Top_K({d : cos(q, d) >= t_q})`` per query.

This is the reference every approximate backend of :mod:`pyterrier_prob.index.search` is measured against, and the
search pEBR's cutoff retrievers (``shared/papers/pebr.md``, Sec. 4.1.2 and Appendix A's ``S_{t,K}``) and UniERF's
branches run by default (MoL's exhaustive candidate stages are blocked torch scans of its own; its approximate ones
go through :mod:`pyterrier_prob.index.search`). Per query block and document chunk one BLAS
``Q_b @ D_c^T``, a vectorised ``>= t_q`` mask (in threads), and -- with a cap K -- each query's threshold raised
to the K-th best score seen so far (a lower bound of its final K-th best), so that later chunks keep few
candidates. No Python loop runs over documents. Scores are cosines: query vectors are L2-normalised here, and
index vectors are normalised at indexing (:class:`~pyterrier_prob.DenseIndex`) or, for a FlexIndex holding
unnormalised vectors, divided by their norms on the fly.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyterrier as pt

from pyterrier_prob.index.dense import DenseIndex, as_dense_index

__all__ = [
    "DOC_BATCH",
    "QUERY_BATCH",
    "CutoffHits",
    "check_num_results",
    "check_thresholds",
    "count_above",
    "doc_scale",
    "docnos_of",
    "f32_ceil",
    "n_threads",
    "query_matrix",
    "search_vectors",
    "threshold_search",
    "unit_rows",
]

QUERY_BATCH = 1024  # queries per block
DOC_BATCH = 16384  # documents per chunk: a block's score matrix is QUERY_BATCH x DOC_BATCH float32 (64 MiB)
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


def n_threads() -> int:
    """CPU threads this process may use (its affinity), at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 16))


def f32_ceil(t: np.ndarray) -> np.ndarray:
    """The smallest float32 >= t, elementwise: for float32 scores s, ``s >= result`` iff ``s >= t``."""
    t = np.asarray(t, dtype=np.float64)
    t32 = t.astype(np.float32)
    up = t32.astype(np.float64) < t
    if up.any():
        t32[up] = np.nextafter(t32[up], np.float32(np.inf))
    return t32


def check_num_results(num_results: Any, allow_none: bool) -> int | None:
    if num_results is None and allow_none:
        return None
    if isinstance(num_results, bool) or not isinstance(num_results, numbers.Integral) or num_results < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"num_results must be {allowed}, got {num_results!r}")
    return int(num_results)


def query_matrix(vecs: Sequence[Any] | np.ndarray, dim: int) -> np.ndarray:
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
    return unit_rows(mat, dim, lambda i: f"row {i}")


def unit_rows(mat: np.ndarray, dim: int, name: Any) -> np.ndarray:
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


def doc_scale(index: DenseIndex) -> np.ndarray | None:
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


def docnos_of(index: Any, docids: np.ndarray) -> np.ndarray:
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


def check_thresholds(thresholds: Any, n: int) -> np.ndarray:
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
        self.n = n_threads()
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
    return search_vectors(
        index.vectors(),
        Q,
        thresholds,
        num_results,
        scale=doc_scale(index),
        batch_size=batch_size,
        doc_batch_size=doc_batch_size,
        verbose=verbose,
    )


def search_vectors(
    vecs: np.ndarray,
    Q: np.ndarray,
    thresholds: np.ndarray,
    num_results: int | None,
    *,
    scale: np.ndarray | None = None,
    batch_size: int = QUERY_BATCH,
    doc_batch_size: int = DOC_BATCH,
    verbose: bool = False,
) -> CutoffHits:
    """The exact ``Top_K({d : <q, d> * scale_d >= t_q})`` of float32 query rows ``Q`` over the rows of ``vecs``
    (an array or memmap, read in chunks of ``doc_batch_size``); inner products, no normalisation here."""
    t32 = f32_ceil(thresholds)
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
    Q = query_matrix(query_vecs, index.dim)
    t = check_thresholds(thresholds, Q.shape[0])
    k = check_num_results(num_results, allow_none=True)
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
    Q = query_matrix(query_vecs, index.dim)
    t32 = f32_ceil(check_thresholds(thresholds, Q.shape[0]))
    index.check_finite()
    vecs, scale = index.vectors(), doc_scale(index)
    counts = np.zeros(Q.shape[0], np.int64)
    with _Masker() as masker:
        for q0 in range(0, Q.shape[0], batch_size):
            q1 = min(Q.shape[0], q0 + batch_size)
            for c0 in range(0, vecs.shape[0], doc_batch_size):
                c1 = min(vecs.shape[0], c0 + doc_batch_size)
                counts[q0:q1] += masker.count(_scores(Q[q0:q1], vecs, scale, c0, c1), t32[q0:q1])
    return counts
