"""The exact, exhaustive search: ``Top_K({d : cos(q, d) >= t_q})`` per query (pEBR Appendix A's ``S_{t,K}``).

The reference of every approximate backend (``ExactSearcher``): per query block and document chunk one BLAS
``Q_b @ D_c^T`` and a threaded ``>= t_q`` mask; with a cap K each query's threshold is raised to the K-th best score
seen so far, so later chunks keep few candidates. Scores are cosines (unnormalised index vectors scaled on the fly).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyterrier as pt

from pyterrier_prob.index.dense import DenseIndex, as_dense_index
from pyterrier_prob.validation import positive_int
from st_extensions.threads import thread_count

__all__ = [
    "DOC_BATCH",
    "QUERY_BATCH",
    "CutoffHits",
    "candidate_scores",
    "check_thresholds",
    "count_above",
    "doc_scale",
    "docnos_of",
    "f32_ceil",
    "n_threads",
    "pair_scores",
    "query_matrix",
    "search_vectors",
    "sort_hits",
    "threshold_search",
    "top_per_query",
    "unit_rows",
]

QUERY_BATCH = 1024  # queries per block
DOC_BATCH = 16384  # documents per chunk: a block's score matrix is QUERY_BATCH x DOC_BATCH float32 (64 MiB)
_PARALLEL_MIN = 1 << 20  # score matrices smaller than this are masked in one thread
_PRUNE_MIN = 1 << 22  # candidates kept across chunks before pruning to each query's best k ...
_PRUNE_FACTOR = 8  # ... and at least _PRUNE_FACTOR * k per query of the block


@dataclass(frozen=True)
class CutoffHits:
    """Hits in CSR form: query i's are ``docids[offsets[i]:offsets[i+1]]`` (index rows) with ``scores`` in the same
    slice, best first (ties: lower docid first)."""

    offsets: np.ndarray  # (Q + 1,) int64
    docids: np.ndarray  # (total,) int64
    scores: np.ndarray  # (total,) float32

    @property
    def counts(self) -> np.ndarray:
        """Number of hits per query."""
        return np.diff(self.offsets)

    @classmethod
    def from_parts(cls, counts: np.ndarray, docids: list[np.ndarray], scores: list[np.ndarray]) -> CutoffHits:
        """Hits from the per-query counts and the docid / score arrays in query order."""
        offsets = np.r_[0, np.cumsum(counts)].astype(np.int64)
        d = np.concatenate(docids).astype(np.int64) if docids else np.zeros(0, np.int64)
        return cls(offsets, d, np.concatenate(scores).astype(np.float32) if scores else np.zeros(0, np.float32))


def n_threads() -> int:
    """Threads of the search's own pool: the run's (:func:`st_extensions.threads.thread_count`: ``--threads``, else
    the CPUs this process may use), at most 16."""
    return min(thread_count(), 16)


def f32_ceil(t: np.ndarray) -> np.ndarray:
    """The smallest float32 >= t, elementwise: for float32 scores s, ``s >= result`` iff ``s >= t``."""
    t = np.asarray(t, dtype=np.float64)
    t32 = t.astype(np.float32)
    return np.where(t32 < t, np.nextafter(t32, np.float32(np.inf)), t32)


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
    return unit_rows(mat, dim, lambda i: f"row {i}")


def unit_rows(mat: np.ndarray, dim: int, name: Any) -> np.ndarray:
    """``mat`` (queries, dim) checked against the index's dimension and L2-normalised (float32, C-contiguous)."""
    if mat.shape[1] != dim:
        raise ValueError(
            f"dimension mismatch: query_vec has {mat.shape[1]} dims but the index holds {dim}-dim vectors "
            "(were queries and documents encoded by the same model?)"
        )
    norms = np.linalg.norm(mat.astype(np.float64), axis=1)
    for bad, what in (
        (~np.isfinite(norms), "has non-finite values (nan or inf)"),
        (norms == 0, "is an all-zero vector: its cosine with any document is undefined"),
    ):
        if bad.any():
            raise ValueError(f"query_vec of {name(int(np.flatnonzero(bad)[0]))} {what}")
    return np.ascontiguousarray(mat / norms[:, None], dtype=np.float32)


def doc_scale(index: DenseIndex) -> np.ndarray | None:
    """``1 / ||d||`` per document when the index's vectors are not unit-norm (None when they are)."""
    if index.normalized:
        return None
    key, vecs = "pyterrier_prob.doc_scale", index.vectors()
    if key not in index._cache:
        chunks = (np.asarray(vecs[i : i + DOC_BATCH], np.float64) for i in range(0, len(vecs), DOC_BATCH))
        norms = np.concatenate([np.linalg.norm(c, axis=1) for c in chunks])
        with np.errstate(divide="ignore"):
            scale = np.where(norms > 0, 1.0 / norms, 0.0).astype(np.float32)
        index._cache[key] = None if np.allclose(norms, 1.0, rtol=0, atol=1e-4) else scale
    return index._cache[key]


def docnos_of(index: Any, docids: np.ndarray) -> np.ndarray:
    """Docnos (object array) of index rows; many lookups go through a cached array of all docnos."""
    if not docids.size:
        return np.zeros(0, dtype=object)
    if "pyterrier_prob.docnos" in index._cache or docids.size >= len(index) // 4:
        return index.docno_array()[docids]
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


class _Masker(ThreadPoolExecutor):
    """``flatnonzero(S >= t[:, None])``, split over row slices in threads for large score matrices."""

    def __init__(self) -> None:
        self.n = n_threads()
        super().__init__(self.n)

    def __call__(self, S: np.ndarray, t: np.ndarray, count: bool = False) -> np.ndarray:
        """Flat indices of the entries ``S[i, j] >= t[i]`` (``count``: per row, their number)."""

        def part(r0: int, r1: int) -> np.ndarray:
            mask = S[r0:r1] >= t[r0:r1, None]
            return np.count_nonzero(mask, axis=1) if count else np.flatnonzero(mask) + r0 * S.shape[1]

        if self.n == 1 or S.size < _PARALLEL_MIN or S.shape[0] < 2:
            return part(0, S.shape[0])
        bounds = np.linspace(0, S.shape[0], min(self.n, S.shape[0]) + 1).astype(int)
        return np.concatenate(list(self.map(part, bounds[:-1], bounds[1:])))


def _scores(Qb: np.ndarray, vecs: np.ndarray, scale: np.ndarray | None, c0: int, c1: int) -> np.ndarray:
    S = Qb @ np.asarray(vecs[c0:c1], dtype=np.float32).T  # an fp16 memmap: converted chunk by chunk
    if scale is not None:
        S *= scale[c0:c1]
    return S


def _prune(
    qi: np.ndarray, di: np.ndarray, sc: np.ndarray, eff: np.ndarray, k: int, grouped: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raise eff[q] to the k-th best score of each query with more than k candidates; keep those at or above it."""
    counts = np.bincount(qi, minlength=eff.shape[0])
    order = None if grouped else np.argsort(qi, kind="stable")  # grouped: candidates already sorted by query
    ends = np.cumsum(counts)
    for q in np.flatnonzero(counts > k):
        seg = sc[ends[q] - counts[q] : ends[q]] if order is None else sc[order[ends[q] - counts[q] : ends[q]]]
        eff[q] = max(eff[q], np.partition(seg, seg.size - k)[seg.size - k])
    keep = sc >= eff[qi]
    return qi[keep], di[keep], sc[keep]


def _search_block(
    Qb: np.ndarray,
    eff: np.ndarray,
    vecs: np.ndarray,
    scale: np.ndarray | None,
    k: int | None,
    doc_batch: int,
    masker: _Masker,
) -> CutoffHits:
    """The hits of one query block."""
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
            if (rows := np.flatnonzero(masker(S, eff, count=True) > k)).size:
                eff[rows] = np.maximum(eff[rows], np.partition(S[rows], C - k, axis=1)[:, C - k])
        flat = masker(S, eff)
        qi = flat // C
        sc = S.reshape(-1)[flat]
        di = flat - qi * C + c0
        if k is not None and flat.size > k:
            qi, di, sc = _prune(qi, di, sc, eff, k, grouped=True)
        parts.append((qi, di, sc))
        total += qi.size
        if budget is not None and total > budget and len(parts) > 1:  # prune across chunks
            parts = [_prune(*(np.concatenate(x) for x in zip(*parts)), eff, k, grouped=False)]
            total = parts[0][0].size
    return sort_hits(B, *(np.concatenate(x) for x in zip(*parts)), k)


def sort_hits(B: int, qi: np.ndarray, di: np.ndarray, sc: np.ndarray, k: int | None) -> CutoffHits:
    """Each of the ``B`` queries' best ``k`` of the distinct (query ``qi``, docid ``di``, score ``sc``) candidates
    (ties: lower docid); one sort per query beats one 3-key sort of all."""
    order = np.argsort(qi, kind="stable")
    counts = np.bincount(qi, minlength=B)
    ends = np.cumsum(counts)
    di, sc = di[order], sc[order]
    out_d, out_s = [], []
    for q in np.flatnonzero(counts):
        s, d = sc[ends[q] - counts[q] : ends[q]], di[ends[q] - counts[q] : ends[q]]
        if k is not None and s.size > k:  # the k best and everything tied with the k-th
            keep = s >= np.partition(s, s.size - k)[s.size - k]
            s, d = s[keep], d[keep]
        o = np.lexsort((d, -s))[:k]
        out_s.append(s[o])
        out_d.append(d[o])
        counts[q] = o.size
    return CutoffHits.from_parts(counts, out_d, out_s)


def top_per_query(qi: np.ndarray, keys: np.ndarray, scores: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Indices of each query's k best pairs, grouped by query, best first (ties: lower ``keys``), and their ranks."""
    order = np.lexsort((keys, -scores, qi))
    q = qi[order]
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    rank = np.arange(q.size, dtype=np.int64) - np.repeat(starts, np.diff(np.r_[starts, q.size]))
    if k is None:
        return order, rank
    keep = rank < k
    return order[keep], rank[keep]


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
    """The exact ``Top_K({d : <q, d> * scale_d >= t_q})`` of float32 rows ``Q`` over ``vecs`` (array or memmap,
    read in chunks); inner products, no normalisation here."""
    t32, b, k, dbs = f32_ceil(thresholds), batch_size, num_results, doc_batch_size
    quiet = not verbose or Q.shape[0] <= b
    blocks = pt.tqdm(range(0, Q.shape[0], b), desc="cutoff retrieval", unit="qblock", disable=quiet)
    with _Masker() as m:
        hits = [_search_block(Q[q : q + b], t32[q : q + b].copy(), vecs, scale, k, dbs, m) for q in blocks]
    counts = np.concatenate([h.counts for h in hits] or [np.zeros(0, np.int64)])
    return CutoffHits.from_parts(counts, [h.docids for h in hits], [h.scores for h in hits])


def pair_scores(
    vecs: np.ndarray, scale: np.ndarray | None, Q: np.ndarray, qi: np.ndarray, docids: np.ndarray
) -> np.ndarray:
    """The exact scores ``<Q[qi], vecs[docids]> * scale[docids]`` of pairs (rows read in docid order)."""
    out = np.empty(docids.size, np.float32)
    order = np.argsort(docids, kind="stable")
    for a in range(0, order.size, DOC_BATCH * 4):
        o = order[a : a + DOC_BATCH * 4]
        out[o] = np.einsum("ij,ij->i", Q[qi[o]], np.asarray(vecs[docids[o]], dtype=np.float32))
    return out if scale is None else out * scale[docids]


def candidate_scores(index: DenseIndex, Q: np.ndarray, qi: np.ndarray, docids: np.ndarray) -> np.ndarray:
    """The exact cosines of (query row, index row) pairs; a non-finite stored vector raises, naming the file."""
    scores = pair_scores(index.vectors(), doc_scale(index), Q, qi, docids)
    if not np.isfinite(scores).all():  # the query vectors are finite: a stored vector is not
        index.check_finite()
        raise ValueError(f"non-finite scores of candidates in {index!r}: rebuild the index")
    return scores


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
    """Exact ``Top_K({d : cos(q, d) >= t_q})`` for every query (pEBR Appendix A's ``S_{t,K}``) as
    :class:`CutoffHits`, over a DenseIndex / FlexIndex; ``query_vecs`` are normalised here; ``thresholds``: a scalar
    or one per query (``-inf``: top-K); ``num_results``: the cap K (``None``: no cap)."""
    index, Q, t = _checked_queries(index, query_vecs, thresholds)
    k = positive_int("num_results", num_results, allow_none=True)
    kw = {"batch_size": int(batch_size), "doc_batch_size": int(doc_batch_size), "verbose": verbose}
    return search_vectors(index.vectors(), Q, t, k, scale=doc_scale(index), **kw)


def _checked_queries(index: Any, query_vecs: Any, thresholds: Any) -> tuple[DenseIndex, np.ndarray, np.ndarray]:
    """The index (its vectors checked for nan/inf once), the unit query rows and one threshold per query."""
    index = as_dense_index(index)
    Q = query_matrix(query_vecs, index.dim)
    t = check_thresholds(thresholds, Q.shape[0])
    index.check_finite()
    return index, Q, t


def count_above(
    index: Any,
    query_vecs: np.ndarray | Sequence[np.ndarray],
    thresholds: float | np.ndarray,
    *,
    batch_size: int = QUERY_BATCH,
    doc_batch_size: int = DOC_BATCH,
) -> np.ndarray:
    """``(Q,)`` int64 counts of documents with ``cos(q, d) >= t_q`` per query, without materialising the hits
    (to calibrate thresholds to a mean depth, Sec. 4.1.3)."""
    index, Q, t = _checked_queries(index, query_vecs, thresholds)
    t32, vecs, scale = f32_ceil(t), index.vectors(), doc_scale(index)
    counts = np.zeros(Q.shape[0], np.int64)
    with _Masker() as masker:
        for q0 in range(0, Q.shape[0], batch_size):
            q1 = min(Q.shape[0], q0 + batch_size)
            for c0 in range(0, vecs.shape[0], doc_batch_size):
                c1 = min(vecs.shape[0], c0 + doc_batch_size)
                counts[q0:q1] += masker(_scores(Q[q0:q1], vecs, scale, c0, c1), t32[q0:q1], count=True)
    return counts
