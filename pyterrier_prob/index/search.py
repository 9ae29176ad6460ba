"""One search layer for every dense retriever of the package: exact, faiss IVF / HNSW / GPU, and shards.

A :class:`Searcher` answers one question, the one pEBR's cutoffs (``shared/papers/pebr.md``, Appendix A's
``S_{t,K}(q) = Top_K({d : <q, d> >= t_q})``), MoL's candidate stages (``shared/papers/mixture-of-logits.txt``,
Sec. 3 and Sec. 4's candidate retrieval) and UniERF's branches all ask of a set of vectors::

    hits = searcher.search(query_vectors, thresholds, num_results)   # CutoffHits, CSR, best first

with one threshold per query (``-inf``: plain top-K) and an optional cap K (``None``: a range search, every
document above the threshold). Scores are inner products of the rows given (the caller normalises for cosines).

Backends (``backend=`` of :func:`make_searcher`, :meth:`DenseIndex.searcher`):

* ``exact`` -- :class:`ExactSearcher`, the blocked BLAS scan of :mod:`pyterrier_prob.index.exact`; the reference.
* ``flat``, ``flat_fp16`` -- a faiss flat index (fp16: ``IndexScalarQuantizer(QT_fp16)``, half the memory).
* ``ivf_flat``, ``ivf_fp16``, ``ivf_sq8``, ``ivf_pq`` -- faiss IVF with ``nlist`` lists (k-means on a seeded sample
  of ``train_size`` vectors), full, fp16, 8-bit scalar-quantised or product-quantised codes; searched with
  ``nprobe`` lists per query.
* ``hnsw`` -- faiss ``IndexHNSWFlat`` (``M`` links, ``ef_construction``), searched with ``ef_search``.

Any faiss backend runs on the GPU with ``gpu=True`` (or ``None``: when faiss sees a GPU and the backend has a GPU
version -- all but HNSW); the same call runs on the CPU otherwise. The backend name then reads ``gpu_<backend>``.

How each kind of search runs on an approximate index:

* top-K (all thresholds ``-inf``): faiss k-NN;
* capped range (finite thresholds and K): the k-NN of depth K, then ``>= t_q`` -- ``S_{t,K}`` is the top K cut at
  the threshold, so this is exact whenever the k-NN is;
* uncapped range: faiss ``range_search`` per query at its own radius (IVF: the ``nprobe`` lists scanned; HNSW: the
  ``ef_search`` beam; flat: everything), in threads. With ``probe_margin`` an IVF range search probes, per query,
  every list whose centroid scores at least ``t_q - probe_margin`` (``range_search_preassigned``): the lists a
  threshold needs grow with the depth it admits, so broad queries get many probes and narrow ones few. faiss' GPU
  indexes have no range search: there the k-NN depth is doubled until the K-th score falls below the threshold (at
  most faiss' GPU limit of 2048, then the CPU index).

Lossy codes (fp16, SQ8, PQ) give approximate scores. With ``rescore=True`` (the default when the exact vectors are
at hand) every candidate is re-scored from the exact vectors and the list re-sorted, so returned scores are exact
and no returned document is below its threshold; ``range_slack`` lowers the radius of the candidate search by that
much to catch documents whose approximate score fell just below it.

faiss indexes of a :class:`~pyterrier_prob.DenseIndex` are built once and cached in its folder
(``faiss/<backend>-<parameters>.faiss``, written atomically). :class:`ShardedSearcher` searches several searchers over
consecutive row ranges and merges their lists exactly (the merged ``Top_K`` of per-shard ``Top_K`` lists is the
global ``Top_K``); :func:`merge_runs` does the same for PyTerrier result frames retrieved shard by shard, on one
machine or many.
"""

from __future__ import annotations

import copy
import importlib.metadata
import math
import numbers
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.index.dense import DenseIndex
from pyterrier_prob.index.exact import (
    CutoffHits,
    check_num_results,
    check_thresholds,
    doc_scale,
    f32_ceil,
    n_threads,
    search_vectors,
)

__all__ = [
    "BACKENDS",
    "SEARCH_PARAMS",
    "ExactSearcher",
    "FaissSearcher",
    "Searcher",
    "ShardedSearcher",
    "cache_name",
    "hits_from_pairs",
    "import_faiss",
    "make_searcher",
    "merge_runs",
]

#: The backends of :func:`make_searcher`.
BACKENDS = ("exact", "flat", "flat_fp16", "ivf_flat", "ivf_fp16", "ivf_sq8", "ivf_pq", "hnsw")
_IVF = ("ivf_flat", "ivf_fp16", "ivf_sq8", "ivf_pq")
_LOSSY = ("flat_fp16", "ivf_fp16", "ivf_sq8", "ivf_pq")
_ADD_BATCH = 65536  # vectors added to a faiss index at once
_QUERY_BATCH = 256  # queries per faiss k-NN call
_GPU_MAX_K = 2048  # faiss GPU k-NN limit
#: Search parameters of a :class:`FaissSearcher` (:meth:`FaissSearcher.with_params`, ``DenseIndex.searcher``).
SEARCH_PARAMS = ("nprobe", "ef_search", "rescore", "range_slack", "k_factor", "probe_margin")


def import_faiss() -> Any:
    """``import faiss`` with an error that says how to install it, and a warning when two builds are installed."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(
            'faiss is not installed: pip install "pyterrier-prob[cpu]" (faiss-cpu) or "pyterrier-prob[gpu]" '
            "(faiss-gpu, for a CUDA machine); install one of them, not both"
        ) from e
    builds = []
    for name in ("faiss-cpu", "faiss-gpu", "faiss-gpu-cu12", "faiss-gpu-cu11"):
        try:
            importlib.metadata.version(name)
            builds.append(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if len(builds) > 1 and not getattr(import_faiss, "_warned", False):
        import_faiss._warned = True  # type: ignore[attr-defined]
        warnings.warn(
            f"several faiss builds are installed ({', '.join(builds)}): they write the same 'faiss' package over "
            "each other; uninstall all of them and install one (pyterrier-prob[cpu] or pyterrier-prob[gpu])",
            stacklevel=2,
        )
    return faiss


def _query_rows(queries: Any, dim: int) -> np.ndarray:
    Q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
    if Q.ndim != 2 or Q.shape[1] != dim:
        raise ValueError(f"query vectors must have shape (queries, {dim}), got {Q.shape}")
    if not np.isfinite(Q).all():
        raise ValueError(f"query vector of row {int(np.flatnonzero(~np.isfinite(Q).all(axis=1))[0])} is not finite")
    return Q


def hits_from_pairs(
    n_queries: int, qi: np.ndarray, docids: np.ndarray, scores: np.ndarray, num_results: int | None
) -> CutoffHits:
    """:class:`CutoffHits` from (query, docid, score) triples: per query by score, descending (ties: lower docid
    first), duplicates of a (query, docid) dropped, at most ``num_results`` each."""
    qi = np.asarray(qi, np.int64)
    docids = np.asarray(docids, np.int64)
    scores = np.asarray(scores, np.float32)
    order = np.lexsort((docids, -scores, qi))
    qi, docids, scores = qi[order], docids[order], scores[order]
    if qi.size:
        first = np.ones(qi.size, bool)
        first[1:] = (qi[1:] != qi[:-1]) | (docids[1:] != docids[:-1])
        dup = ~first
        if dup.any():  # the same document twice (shards never overlap; k-NN lists never repeat): keep its best
            key = qi * (int(docids.max()) + 1) + docids
            _, keep = np.unique(key, return_index=True)
            keep = np.sort(keep)
            qi, docids, scores = qi[keep], docids[keep], scores[keep]
            order = np.lexsort((docids, -scores, qi))
            qi, docids, scores = qi[order], docids[order], scores[order]
    counts = np.bincount(qi, minlength=n_queries)
    if num_results is not None and qi.size:
        starts = np.cumsum(counts) - counts
        rank = np.arange(qi.size) - starts[qi]
        keep = rank < num_results
        qi, docids, scores = qi[keep], docids[keep], scores[keep]
        counts = np.bincount(qi, minlength=n_queries)
    offsets = np.zeros(n_queries + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return CutoffHits(offsets, docids, scores)


class Searcher(ABC):
    """``Top_K({d : <q, d> >= t_q})`` over a fixed set of ``n_docs`` vectors of dimension ``dim``.

    Attributes:
        backend: the backend's name (``exact``, ``ivf_flat``, ``gpu_ivf_flat``, ``sharded(...)``, ...).
        build_s: seconds it took to build (0 for the exact scan; a cached faiss index: the build's own time).
        memory_bytes: bytes of the searchable structure held in memory (vectors or codes, lists, graph).
    """

    backend: str
    n_docs: int
    dim: int
    build_s: float = 0.0

    @property
    @abstractmethod
    def memory_bytes(self) -> int: ...

    @abstractmethod
    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits: ...

    def search(
        self, queries: Any, thresholds: float | np.ndarray = -np.inf, num_results: int | None = None
    ) -> CutoffHits:
        """Every query's ``Top_K({d : <q, d> >= t_q})``, best first (ties: lower docid first).

        Args:
            queries: ``(Q, dim)`` query vectors (inner products with them; normalise first for cosines).
            thresholds: a scalar or one per query; ``-inf`` keeps everything (top-K).
            num_results: the cap K; ``None``: no cap (a range search; then some threshold must be finite).
        """
        Q = _query_rows(queries, self.dim)
        t = check_thresholds(thresholds, Q.shape[0])
        k = check_num_results(num_results, allow_none=True)
        if k is None and np.isneginf(t).any():
            raise ValueError("a search without num_results needs a finite threshold for every query (range search)")
        if not Q.shape[0]:
            return CutoffHits(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))
        return self._search(Q, t, k)

    def with_params(self, **params: Any) -> Searcher:
        """A copy with other search parameters; the exact scan and shards have none."""
        if params:
            raise ValueError(f"the {self.backend} backend has no search parameters (got {sorted(params)})")
        return self

    def setting(self) -> str:
        """The search parameters, as a short string."""
        return "-"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, n_docs={self.n_docs}, dim={self.dim})"


class ExactSearcher(Searcher):
    """The exact scan (:func:`~pyterrier_prob.index.exact.search_vectors`) over a ``(n_docs, dim)`` array/memmap.

    Args:
        vectors: the document vectors (any float dtype; read in chunks).
        scale: optional per-document factor of the scores (``1 / ||d||`` for cosines of unnormalised vectors).
    """

    backend = "exact"

    def __init__(self, vectors: np.ndarray, scale: np.ndarray | None = None) -> None:
        if np.ndim(vectors) != 2:
            raise ValueError(f"vectors must have shape (documents, dim), got {np.shape(vectors)}")
        self.vectors = vectors
        self.scale = scale
        self.n_docs, self.dim = (int(x) for x in vectors.shape)

    @property
    def memory_bytes(self) -> int:
        return int(self.vectors.nbytes)

    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits:
        if self.vectors.dtype == np.float32 or self.vectors.shape[0] <= 1:
            return search_vectors(self.vectors, Q, t, k, scale=self.scale)
        return search_vectors(_Float32Rows(self.vectors), Q, t, k, scale=self.scale)


class _Float32Rows:
    """Row slices of a non-float32 array (an fp16 memmap) as float32, for the exact scan's chunks."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr
        self.shape = arr.shape

    def __getitem__(self, s: Any) -> np.ndarray:
        return np.asarray(self.arr[s], dtype=np.float32)


class FaissSearcher(Searcher):
    """A faiss index over the vectors (see the module docstring for the backends and how each search runs).

    Build with :func:`make_searcher` or :meth:`DenseIndex.searcher`; search parameters can be changed on the
    object (``searcher.nprobe = 64``) or on a copy (:meth:`with_params`), which shares the built index.
    """

    def __init__(
        self,
        index: Any,
        backend: str,
        *,
        vectors: np.ndarray | None = None,
        scale: np.ndarray | None = None,
        nprobe: int | None = None,
        ef_search: int | None = None,
        rescore: bool | None = None,
        range_slack: float = 0.0,
        k_factor: int = 1,
        probe_margin: float | None = None,
        build_s: float = 0.0,
        memory_bytes: int | None = None,
    ) -> None:
        self.index = index
        self.cpu_index = index
        self._backend = backend
        self.n_docs, self.dim = int(index.ntotal), int(index.d)
        self.vectors = vectors
        self.scale = scale
        self.nprobe = nprobe
        self.ef_search = ef_search
        if rescore is None:
            rescore = backend in _LOSSY and vectors is not None
        if rescore and vectors is None:
            raise ValueError("rescore=True needs the exact vectors (vectors=...)")
        self.rescore = bool(rescore)
        self.range_slack = float(range_slack)
        self.k_factor = _check_pos("k_factor", k_factor)
        self.probe_margin = _check_margin(probe_margin, backend)
        self.last_probes: np.ndarray | None = None  # lists probed per query by the last adaptive range search
        self.build_s = float(build_s)
        self._memory = memory_bytes
        self.on_gpu = False

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"gpu_{self._backend}" if self.on_gpu else self._backend

    @property
    def memory_bytes(self) -> int:
        if self._memory is None:
            faiss = import_faiss()
            self._memory = int(faiss.serialize_index(self.cpu_index).nbytes)
        return self._memory

    def to_gpu(self) -> FaissSearcher:  # pragma: no cover - needs faiss-gpu and a GPU
        """This searcher on GPU 0 (faiss ``index_cpu_to_gpu``); HNSW has no GPU version."""
        faiss = import_faiss()
        if self._backend == "hnsw":
            raise ValueError("faiss has no GPU HNSW: use ivf_* or flat on the GPU")
        if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
            raise RuntimeError("no GPU faiss: install pyterrier-prob[gpu] (faiss-gpu) on a machine with a CUDA GPU")
        out = copy.copy(self)
        out._res = faiss.StandardGpuResources()
        out.index = faiss.index_cpu_to_gpu(out._res, 0, self.cpu_index)
        out.on_gpu = True
        return out

    def with_params(self, **params: Any) -> FaissSearcher:
        """A copy with other search parameters (:data:`SEARCH_PARAMS`)."""
        out = copy.copy(self)
        for name, value in params.items():
            if name not in SEARCH_PARAMS:
                raise ValueError(f"unknown search parameter {name!r} ({', '.join(SEARCH_PARAMS)})")
            setattr(out, name, value)
        if out.rescore and out.vectors is None:
            raise ValueError("rescore=True needs the exact vectors (vectors=...)")
        out.k_factor = _check_pos("k_factor", out.k_factor)
        out.probe_margin = _check_margin(out.probe_margin, self._backend)
        return out

    def setting(self) -> str:
        """The search parameters, as a short string (``nprobe=64``)."""
        parts = []
        if self._backend in _IVF:
            parts.append(f"nprobe={self._nprobe()}")
            if self.probe_margin is not None:
                parts.append(f"probe_margin={self.probe_margin:g}")
        if self._backend == "hnsw":
            parts.append(f"ef_search={self._ef()}")
        if self.range_slack:
            parts.append(f"range_slack={self.range_slack:g}")
        if self.k_factor != 1:
            parts.append(f"k_factor={self.k_factor}")
        return ",".join(parts) or "-"

    # ---- parameters ------------------------------------------------------------------------------------------
    def _nprobe(self) -> int:
        return int(self.nprobe) if self.nprobe is not None else int(self.cpu_index.nprobe)

    def _ef(self) -> int:
        return int(self.ef_search) if self.ef_search is not None else int(self.cpu_index.hnsw.efSearch)

    def _apply(self, k: int = 0) -> None:
        if self._backend in _IVF:
            self.index.nprobe = self._nprobe()
            if self.index is not self.cpu_index:
                self.cpu_index.nprobe = self._nprobe()
        if self._backend == "hnsw":
            self.cpu_index.hnsw.efSearch = max(self._ef(), k)

    # ---- search ------------------------------------------------------------------------------------------------
    def _knn(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.n_docs)
        self._apply(k)
        index = self.index if not (self.on_gpu and k > _GPU_MAX_K) else self.cpu_index
        D = np.empty((Q.shape[0], k), np.float32)
        ids = np.empty((Q.shape[0], k), np.int64)
        for q0 in range(0, Q.shape[0], _QUERY_BATCH):
            D[q0 : q0 + _QUERY_BATCH], ids[q0 : q0 + _QUERY_BATCH] = index.search(Q[q0 : q0 + _QUERY_BATCH], k)
        return D, ids

    def _exact_scores(self, Q: np.ndarray, qi: np.ndarray, docids: np.ndarray) -> np.ndarray:
        order = np.argsort(docids, kind="stable")  # sorted reads of a memmap
        rows = np.asarray(self.vectors[docids[order]], dtype=np.float32)
        s = np.empty(docids.size, np.float32)
        s[order] = np.einsum("ij,ij->i", Q[qi[order]], rows)
        if self.scale is not None:
            s *= self.scale[docids]
        return s

    def _finish(
        self, Q: np.ndarray, t: np.ndarray, k: int | None, qi: np.ndarray, docids: np.ndarray, scores: np.ndarray
    ) -> CutoffHits:
        keep = docids >= 0
        qi, docids, scores = qi[keep], docids[keep], scores[keep]
        if self.rescore:
            scores = self._exact_scores(Q, qi, docids)
        keep = scores >= f32_ceil(t)[qi]
        return hits_from_pairs(Q.shape[0], qi[keep], docids[keep], scores[keep], k)

    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits:
        if k is not None:
            D, ids = self._knn(Q, k * self.k_factor if self.rescore else k)
            qi = np.repeat(np.arange(Q.shape[0]), ids.shape[1])
            return self._finish(Q, t, k, qi, ids.reshape(-1), D.reshape(-1))
        if self.on_gpu:  # pragma: no cover - needs faiss-gpu and a GPU
            return self._gpu_range(Q, t)
        return self._range(Q, t)

    def _radius(self, t: np.ndarray) -> np.ndarray:
        """faiss keeps inner products strictly above the radius: one float32 step below each (slackened) t."""
        return np.nextafter(f32_ceil(t - self.range_slack), np.float32(-np.inf))

    def _range(self, Q: np.ndarray, t: np.ndarray) -> CutoffHits:
        self._apply()
        radius = self._radius(t)
        index = self.cpu_index
        if self.probe_margin is not None:
            return self._adaptive_range(Q, t, radius)

        def one(i: int) -> tuple[np.ndarray, np.ndarray]:
            lims, D, ids = index.range_search(Q[i : i + 1], float(radius[i]))
            return D, ids

        n = n_threads()
        if n > 1 and Q.shape[0] > 1:
            with ThreadPoolExecutor(n) as pool:
                parts = list(pool.map(one, range(Q.shape[0])))
        else:
            parts = [one(i) for i in range(Q.shape[0])]
        qi = np.repeat(np.arange(Q.shape[0]), [p[1].size for p in parts])
        D = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.float32)
        ids = np.concatenate([p[1] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        return self._finish(Q, t, None, qi, ids, D)

    def _adaptive_range(self, Q: np.ndarray, t: np.ndarray, radius: np.ndarray) -> CutoffHits:
        """IVF range search probing, per query, every list whose centroid scores at least ``t_q - probe_margin``
        (and at least ``nprobe`` lists): broad queries (low thresholds) probe many lists, narrow ones few."""
        index = self.cpu_index
        nlist = int(index.nlist)
        Dc, Ic = index.quantizer.search(Q, nlist)
        need = np.maximum((Dc >= (t - self.probe_margin)[:, None]).sum(axis=1), min(self._nprobe(), nlist))
        saved_nprobe, saved_mode = index.nprobe, index.parallel_mode
        index.parallel_mode = 1  # one query at a time: faiss' threads share its lists
        parts = []
        try:
            for i in range(Q.shape[0]):
                index.nprobe = int(need[i])
                _, D, ids = index.range_search_preassigned(
                    Q[i : i + 1], float(radius[i]), Ic[i : i + 1, : need[i]], Dc[i : i + 1, : need[i]]
                )
                parts.append((D, ids))
        finally:
            index.nprobe, index.parallel_mode = saved_nprobe, saved_mode
        self.last_probes = need
        qi = np.repeat(np.arange(Q.shape[0]), [p[1].size for p in parts])
        ids = np.concatenate([p[1] for p in parts]).astype(np.int64)
        return self._finish(Q, t, None, qi, ids, np.concatenate([p[0] for p in parts]))

    def _gpu_range(self, Q: np.ndarray, t: np.ndarray) -> CutoffHits:  # pragma: no cover - needs a GPU
        """GPU indexes have no range search: deepen the k-NN until each query's last score is below its radius."""
        radius = self._radius(t)
        k = 64
        todo = np.arange(Q.shape[0])
        qi_parts, d_parts, s_parts = [], [], []
        while todo.size:
            D, ids = self._knn(Q[todo], k)
            done = (D[:, -1] <= radius[todo]) | (k >= self.n_docs) | (k > _GPU_MAX_K)
            for j in np.flatnonzero(done):
                m = D[j] > radius[todo[j]]
                qi_parts.append(np.full(int(m.sum()), todo[j]))
                d_parts.append(ids[j][m])
                s_parts.append(D[j][m])
            todo = todo[~done]
            if todo.size and k > _GPU_MAX_K:
                rest = self._range(Q[todo], t[todo])
                for j, q in enumerate(todo):
                    a, b = rest.offsets[j], rest.offsets[j + 1]
                    qi_parts.append(np.full(b - a, q))
                    d_parts.append(rest.docids[a:b])
                    s_parts.append(rest.scores[a:b])
                break
            k *= 4
        if not qi_parts:
            return hits_from_pairs(Q.shape[0], np.zeros(0), np.zeros(0), np.zeros(0), None)
        return self._finish(Q, t, None, np.concatenate(qi_parts), np.concatenate(d_parts), np.concatenate(s_parts))


class ShardedSearcher(Searcher):
    """Several searchers over consecutive row ranges (shard i holds rows ``offsets[i]:offsets[i+1]``) as one.

    Every shard answers ``Top_K({d : <q, d> >= t_q})`` on its rows; the union, sorted (ties: lower docid) and cut
    at K, is the unsharded answer whenever each shard's is exact -- the global top K is in the union of the shards'
    top K lists. Shards may use different backends (faiss ``IndexShards`` does this for top-k only).
    """

    def __init__(self, shards: Sequence[Searcher]) -> None:
        if not shards:
            raise ValueError("ShardedSearcher needs at least one shard")
        dims = {s.dim for s in shards}
        if len(dims) != 1:
            raise ValueError(f"shards have different dimensions: {sorted(dims)}")
        self.shards = list(shards)
        self.dim = dims.pop()
        self.offsets = np.concatenate([[0], np.cumsum([s.n_docs for s in shards])]).astype(np.int64)
        self.n_docs = int(self.offsets[-1])
        self.backend = f"sharded({','.join(sorted({s.backend for s in shards}))}x{len(shards)})"
        self.build_s = float(sum(s.build_s for s in shards))

    @property
    def memory_bytes(self) -> int:
        return int(sum(s.memory_bytes for s in self.shards))

    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits:
        qi, di, sc = [], [], []
        for shard, off in zip(self.shards, self.offsets[:-1]):
            h = shard.search(Q, t, k)
            qi.append(np.repeat(np.arange(Q.shape[0]), h.counts))
            di.append(h.docids + off)
            sc.append(h.scores)
        return hits_from_pairs(Q.shape[0], np.concatenate(qi), np.concatenate(di), np.concatenate(sc), k)


def _check_margin(value: Any, backend: str) -> float | None:
    if value is None:
        return None
    if backend not in _IVF:
        raise ValueError(f"probe_margin applies to the IVF backends {_IVF}, not {backend!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"probe_margin must be a finite number, got {value!r}")
    return float(value)


def _check_pos(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _build_faiss(
    vectors: np.ndarray,
    backend: str,
    scale: np.ndarray | None,
    nlist: int,
    train_size: int,
    pq_m: int,
    M: int,
    ef_construction: int,
    seed: int,
    verbose: bool,
) -> Any:
    faiss = import_faiss()
    n, d = vectors.shape
    metric = faiss.METRIC_INNER_PRODUCT
    if backend == "flat":
        index = faiss.IndexFlatIP(d)
    elif backend == "flat_fp16":
        index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, metric)
    elif backend == "hnsw":
        index = faiss.IndexHNSWFlat(d, M, metric)
        index.hnsw.efConstruction = ef_construction
    else:
        quantizer = faiss.IndexFlatIP(d)
        if backend == "ivf_flat":
            index = faiss.IndexIVFFlat(quantizer, d, nlist, metric)
        elif backend == "ivf_fp16":
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_fp16, metric)
        elif backend == "ivf_sq8":
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_8bit, metric)
        else:
            if d % pq_m:
                raise ValueError(f"pq_m={pq_m} must divide the dimension {d}")
            index = faiss.IndexIVFPQ(quantizer, d, nlist, pq_m, 8, metric)
        index.own_fields = True
        quantizer.this.disown()
    if not index.is_trained:
        m = min(n, train_size)
        rows = np.sort(np.random.default_rng(seed).choice(n, size=m, replace=False))
        sample = _rows(vectors, rows, scale)
        index.train(sample)
    bar = pt.tqdm(total=n, desc=f"building {backend}", unit="doc", disable=not verbose)
    for a in range(0, n, _ADD_BATCH):
        b = min(n, a + _ADD_BATCH)
        index.add(_rows(vectors, slice(a, b), scale))
        bar.update(b - a)
    bar.close()
    return index


def _rows(vectors: np.ndarray, rows: Any, scale: np.ndarray | None) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(vectors[rows], dtype=np.float32))
    if scale is not None:
        x = x * scale[rows][:, None]
    return x


def make_searcher(
    vectors: np.ndarray,
    backend: str = "exact",
    *,
    scale: np.ndarray | None = None,
    cache_dir: str | os.PathLike | None = None,
    nlist: int | None = None,
    nprobe: int | None = None,
    train_size: int | None = None,
    pq_m: int | None = None,
    M: int = 32,
    ef_construction: int = 80,
    ef_search: int | None = None,
    rescore: bool | None = None,
    range_slack: float = 0.0,
    k_factor: int = 1,
    probe_margin: float | None = None,
    gpu: bool | None = False,
    seed: int = 0,
    verbose: bool = False,
) -> Searcher:
    """A :class:`Searcher` of ``backend`` over ``vectors`` (rows ``(n_docs, dim)``; any float dtype, memmaps too).

    Args:
        vectors: the document vectors; kept (not copied) for the exact scan and for re-scoring.
        backend: one of :data:`BACKENDS`.
        scale: per-document factor of the scores (``1 / ||d||`` to search cosines of unnormalised vectors; the faiss
            index then stores the scaled vectors).
        cache_dir: a folder to keep the built faiss index in, named after the backend and its build parameters
            (:func:`cache_name`; read back when it exists, written atomically).
        nlist: IVF lists (default ``4 * sqrt(n_docs)`` rounded to a power of two, at most n_docs / 39);
            nprobe: lists searched per query (default ``max(1, nlist // 16)``).
        train_size: vectors the IVF k-means (and PQ) trains on (default ``max(64 * nlist, 65536)``, at most n_docs).
        pq_m: PQ sub-quantisers (default dim / 8; must divide dim), 8 bits each.
        M, ef_construction, ef_search: HNSW's links per node, build beam and search beam (default 128).
        rescore: re-score candidates from ``vectors`` (default: for lossy codes).
        range_slack: lower the radius of the candidate range search by this much (lossy codes).
        k_factor: with re-scoring, a top-K search takes ``K * k_factor`` candidates (as faiss' ``IndexRefine``).
        probe_margin: IVF range search with per-query probes: every list whose centroid scores at least
            ``t_q - probe_margin`` (at least ``nprobe`` lists), so that broad queries probe more lists than narrow ones.
        gpu: run on the GPU (``None``: when faiss sees one and the backend has a GPU version).
        seed: the training sample's seed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if np.ndim(vectors) != 2 or not len(vectors):
        raise ValueError(f"vectors must have shape (documents, dim) with at least one row, got {np.shape(vectors)}")
    if backend == "exact":
        if gpu:
            raise ValueError("backend='exact' is the CPU reference scan; for a GPU scan use backend='flat', gpu=True")
        return ExactSearcher(vectors, scale)
    n, d = vectors.shape
    params: dict[str, Any] = {}
    if backend in _IVF:
        if nlist is None:
            nlist = 1 << max(2, round(math.log2(4 * math.sqrt(n))))
            nlist = max(1, min(nlist, n // 39))
        nlist = _check_pos("nlist", nlist)
        if nlist > n:
            raise ValueError(f"nlist={nlist} exceeds the {n} vectors")
        train_size = min(n, _check_pos("train_size", train_size or max(64 * nlist, 65536)))
        params.update(nlist=nlist, train=train_size, seed=seed)
        if backend == "ivf_pq":
            pq_m = _check_pos("pq_m", pq_m or max(1, d // 8))
            params["m"] = pq_m
        nprobe = _check_pos("nprobe", nprobe if nprobe is not None else max(1, nlist // 16))
    elif backend == "hnsw":
        params.update(M=_check_pos("M", M), efc=_check_pos("ef_construction", ef_construction))
        ef_search = _check_pos("ef_search", ef_search if ef_search is not None else 128)
    faiss = import_faiss()
    start = time.perf_counter()
    path = Path(cache_dir) / cache_name(backend, **params) if cache_dir is not None else None
    build_s = None
    if path is not None and path.exists():
        index = faiss.read_index(str(path))
        if index.ntotal != n or index.d != d:
            raise ValueError(
                f"the cached faiss index {str(path)!r} holds {index.ntotal} x {index.d} vectors, not {n} x {d}: "
                "delete it to rebuild"
            )
        meta = path.with_suffix(".build_s")
        build_s = float(meta.read_text()) if meta.exists() else None
    else:
        index = _build_faiss(
            vectors, backend, scale, nlist or 1, train_size or n, pq_m or 1, M, ef_construction, seed, verbose
        )
        build_s = time.perf_counter() - start
        if path is not None:
            atomic_write(path, lambda f: faiss.write_index(index, faiss.PyCallbackIOWriter(f.write)))
            atomic_write(path.with_suffix(".build_s"), f"{build_s:.3f}\n")
    memory = path.stat().st_size if path is not None else None
    out = FaissSearcher(
        index,
        backend,
        vectors=vectors,
        scale=scale,
        nprobe=nprobe,
        ef_search=ef_search,
        rescore=rescore,
        range_slack=range_slack,
        k_factor=k_factor,
        probe_margin=probe_margin,
        build_s=build_s if build_s is not None else float("nan"),
        memory_bytes=memory,
    )
    if gpu is None:
        gpu = backend != "hnsw" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    return out.to_gpu() if gpu else out


def cache_name(backend: str, **params: Any) -> str:
    """The file name a faiss index of these build parameters is cached under (``ivf_sq8-nlist1024-seed0-...``)."""
    return backend + "".join(f"-{k}{v}" for k, v in sorted(params.items()) if v is not None) + ".faiss"


def merge_runs(runs: Sequence[pd.DataFrame], num_results: int | None = None) -> pd.DataFrame:
    """Merge result frames retrieved shard by shard (each over its own documents) into one run.

    Every shard's frame holds, per qid, that shard's ``Top_K({d : s >= t_q})``; the merged frame holds each qid's
    best ``num_results`` of their union (all of it with ``None``), sorted by score, with ``rank`` from 0 -- what the
    same retriever gives on the unsharded collection (up to the order of tied scores: docno here, the index row
    there). A docno in two shards is an error.
    """
    if not len(runs):
        raise ValueError("merge_runs needs at least one run")
    for i, r in enumerate(runs):
        missing = [c for c in ("qid", "docno", "score") if c not in r.columns]
        if missing:
            raise ValueError(f"run {i} has no column(s) {missing} (columns: {list(r.columns)})")
    k = check_num_results(num_results, allow_none=True)
    frames = [
        r.drop(columns=[c for c in ("rank", "docid") if c in r.columns]).assign(_shard=i) for i, r in enumerate(runs)
    ]
    allr = pd.concat(frames, ignore_index=True)
    dup = allr.duplicated(["qid", "docno"], keep=False)
    if dup.any():
        row = allr[dup].iloc[0]
        shards = sorted(allr[dup & (allr["qid"] == row["qid"]) & (allr["docno"] == row["docno"])]["_shard"])
        raise ValueError(
            f"docno {row['docno']!r} of qid {row['qid']!r} is in runs {shards}: shards must hold disjoint documents"
        )
    allr["_q"] = pd.factorize(allr["qid"])[0]  # qids in order of first appearance, as the shards' runs list them
    allr = allr.sort_values(["_q", "score", "docno"], ascending=[True, False, True], kind="stable")
    allr["rank"] = allr.groupby("_q", sort=False).cumcount().astype(np.int64)
    if k is not None:
        allr = allr[allr["rank"] < k]
    return allr.drop(columns=["_shard", "_q"]).reset_index(drop=True)


# attached here, as pyterrier-dr attaches its retrievers to FlexIndex: the index module never imports this one
def _dense_searcher(self: DenseIndex, backend: str = "exact", *, gpu: bool | None = False, **params: Any) -> Searcher:
    """A :class:`~pyterrier_prob.index.search.Searcher` over this index's vectors (cosines).

    ``backend`` is one of :data:`~pyterrier_prob.index.search.BACKENDS` (``exact``, ``flat``, ``flat_fp16``,
    ``ivf_flat``, ``ivf_fp16``, ``ivf_sq8``, ``ivf_pq``, ``hnsw``); ``params`` are those of
    :func:`~pyterrier_prob.index.search.make_searcher` (``nlist``, ``nprobe``, ``M``, ``ef_search``, ...). A faiss
    index is built once and cached in this folder (``faiss/``, written atomically) and in memory; search
    parameters (``nprobe``, ``ef_search``, ``rescore``, ``range_slack``, ``k_factor``) give copies sharing it.
    Pass the result as ``searcher=`` to the cutoff retrievers (``CDFCutoffRetriever(index, p=..., searcher=...)``).
    """
    self.check_finite()
    search_params = {k: params.pop(k) for k in SEARCH_PARAMS if k in params}
    key = ("pyterrier_prob.searcher", backend, bool(gpu), tuple(sorted(params.items())))
    if key not in self._cache:
        self._cache[key] = make_searcher(
            self.vectors(), backend, scale=doc_scale(self), cache_dir=self.index_path / "faiss", gpu=gpu, **params
        )
    out = self._cache[key]
    return out.with_params(**search_params) if search_params else out


DenseIndex.searcher = _dense_searcher
