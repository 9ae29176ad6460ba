"""One search layer for every dense retriever: exact, faiss IVF / HNSW / GPU, and shards.

A :class:`Searcher` answers pEBR's ``S_{t,K}(q) = Top_K({d : <q, d> >= t_q})`` (Appendix A) for a batch of queries;
it is the one ``searcher=`` type of pEBR's cutoffs, MoL's candidate stages and UniERF's branches. Build one with
:func:`make_searcher`, ``DenseIndex.searcher(...)`` or ``MoLIndex.searcher(part, ...)``; how each backend searches
and its defaults: ``docs/scale.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import math
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.index.dense import DenseIndex
from pyterrier_prob.index.exact import (
    CutoffHits,
    check_thresholds,
    doc_scale,
    f32_ceil,
    n_threads,
    pair_scores,
    search_vectors,
    sort_hits,
)
from pyterrier_prob.validation import choice, finite_float, positive_int

__all__ = [
    "BACKENDS",
    "SEARCH_PARAMS",
    "ExactSearcher",
    "FaissSearcher",
    "SearchSettings",
    "Searcher",
    "ShardedSearcher",
    "cache_name",
    "check_searcher",
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
_GPU_MAX_K = 2048  # faiss GPU k-NN limit: a GPU range search deeper than this goes to the CPU index
#: Search parameters of a :class:`FaissSearcher` (:meth:`FaissSearcher.with_params`, ``DenseIndex.searcher``).
SEARCH_PARAMS = ("nprobe", "ef_search", "rescore", "range_slack", "k_factor", "probe_margin")


@dataclass(frozen=True)
class SearchSettings:
    """Build parameters (``nlist``, ``train_size``, ``pq_m``, ``M``, ``ef_construction``, ``seed``: part of the cache
    name) and search parameters (:data:`SEARCH_PARAMS`) of a faiss backend; meanings and defaults: ``docs/scale.md``.
    """

    nlist: int | None = None
    train_size: int | None = None
    pq_m: int | None = None
    M: int = 32
    ef_construction: int = 80
    seed: int = 0
    nprobe: int | None = None
    ef_search: int | None = None
    rescore: bool | None = None
    range_slack: float = 0.0
    k_factor: int = 1
    probe_margin: float | None = None

    def with_build_defaults(self, backend: str, n: int, d: int) -> tuple[SearchSettings, dict[str, Any]]:
        """These settings with the size-dependent defaults filled in, and the build parameters naming the cache."""
        s = self
        if backend in _IVF:
            auto = max(1, min(1 << max(2, round(math.log2(4 * math.sqrt(n)))), n // 39))
            nlist = positive_int("nlist", auto if s.nlist is None else s.nlist)
            if nlist > n:
                raise ValueError(f"nlist={nlist} exceeds the {n} vectors")
            train = min(n, positive_int("train_size", s.train_size or max(64 * nlist, 65536)))
            pq_m = positive_int("pq_m", s.pq_m or max(1, d // 8)) if backend == "ivf_pq" else None
            nprobe = s.nprobe if s.nprobe is not None else max(1, nlist // 16)
            s = dataclasses.replace(s, nlist=nlist, train_size=train, pq_m=pq_m, nprobe=nprobe)
            return s, {"nlist": nlist, "train": train, "seed": s.seed, "m": pq_m}
        if backend == "hnsw":
            build = {"M": positive_int("M", s.M), "efc": positive_int("ef_construction", s.ef_construction)}
            return dataclasses.replace(s, ef_search=128 if s.ef_search is None else s.ef_search), build
        return s, {}

    def checked(self, backend: str, has_vectors: bool) -> SearchSettings:
        """The search parameters checked for ``backend`` (``rescore=None``: re-score lossy codes when possible)."""
        rescore = (backend in _LOSSY and has_vectors) if self.rescore is None else bool(self.rescore)
        if rescore and not has_vectors:
            raise ValueError("rescore=True needs the exact vectors (vectors=...)")
        if self.probe_margin is not None and backend not in _IVF:
            raise ValueError(f"probe_margin applies to the IVF backends {_IVF}, not {backend!r}")
        return dataclasses.replace(
            self,
            nprobe=positive_int("nprobe", self.nprobe, allow_none=True),
            ef_search=positive_int("ef_search", self.ef_search, allow_none=True),
            rescore=rescore,
            range_slack=finite_float("range_slack", self.range_slack),
            k_factor=positive_int("k_factor", self.k_factor),
            probe_margin=finite_float("probe_margin", self.probe_margin, allow_none=True),
        )


def _settings(settings: SearchSettings | None, params: dict[str, Any], names: Sequence[str]) -> SearchSettings:
    if unknown := sorted(set(params) - set(names)):
        raise ValueError(f"unknown search parameter {unknown[0]!r} ({', '.join(names)})")
    return dataclasses.replace(settings or SearchSettings(), **params)


def import_faiss() -> Any:
    """``import faiss`` with an error that says how to install it, and a warning when two builds are installed."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(
            'faiss is not installed: pip install "pyterrier-prob[cpu]" (faiss-cpu) or "pyterrier-prob[gpu]" '
            "(faiss-gpu, for a CUDA machine); install one of them, not both"
        ) from e
    if not getattr(import_faiss, "_checked", False):  # once per process: the distributions that installed 'faiss'
        import_faiss._checked = True  # type: ignore[attr-defined]
        builds = sorted(set(importlib.metadata.packages_distributions().get("faiss", [])))
        if len(builds) > 1:
            warnings.warn(
                f"several faiss builds are installed ({', '.join(builds)}): they write the same 'faiss' package over "
                "each other; uninstall all of them and install one (pyterrier-prob[cpu] or pyterrier-prob[gpu])",
                stacklevel=2,
            )
    return faiss


def hits_from_pairs(
    n_queries: int, qi: np.ndarray, docids: np.ndarray, scores: np.ndarray, num_results: int | None
) -> CutoffHits:
    """:class:`CutoffHits` from (query, docid, score) triples: per query best first (ties: lower docid), a repeated
    (query, docid) kept once (its best score), at most ``num_results`` each."""
    qi, docids, scores = np.asarray(qi, np.int64), np.asarray(docids, np.int64), np.asarray(scores, np.float32)
    if qi.size:  # each (query, docid) once: the first of its run, sorted best first
        key = qi * (int(docids.max()) + 1) + docids
        order = np.lexsort((-scores, key))
        order = order[np.r_[True, key[order][1:] != key[order][:-1]]]
        qi, docids, scores = qi[order], docids[order], scores[order]
    return sort_hits(n_queries, qi, docids, scores, num_results)


class Searcher(ABC):
    """``Top_K({d : <q, d> >= t_q})`` over ``n_docs`` vectors of dimension ``dim``; ``backend`` names it
    (``ivf_flat``, ``gpu_ivf_flat``, ``sharded(...)``), ``build_s`` is its build time, ``memory_bytes`` its size."""

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
        """Every query's ``Top_K({d : <q, d> >= t_q})`` as :class:`CutoffHits`, best first (ties: lower docid).

        ``queries``: ``(Q, dim)`` (inner products: normalise first for cosines); ``thresholds``: a scalar or one per
        query (``-inf``: top-K); ``num_results``: the cap K (``None``: a range search, finite thresholds needed).
        """
        Q = np.ascontiguousarray(np.asarray(queries, dtype=np.float32))
        if Q.ndim != 2 or Q.shape[1] != self.dim:
            raise ValueError(f"query vectors must have shape (queries, {self.dim}), got {Q.shape}")
        if not np.isfinite(Q).all():
            raise ValueError(f"query vector of row {int(np.flatnonzero(~np.isfinite(Q).all(axis=1))[0])} is not finite")
        t = check_thresholds(thresholds, Q.shape[0])
        k = positive_int("num_results", num_results, allow_none=True)
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


def check_searcher(searcher: Any, n_docs: int, dim: int, what: str) -> Searcher | None:
    """``searcher`` (or None) checked to be a :class:`Searcher` over the ``n_docs`` x ``dim`` vectors of ``what``."""
    if searcher is not None:
        if not isinstance(searcher, Searcher):
            raise TypeError(
                f"searcher must be a pyterrier_prob.index.Searcher (e.g. index.searcher('ivf_flat')), got "
                f"{type(searcher).__name__}"
            )
        if (searcher.n_docs, searcher.dim) != (n_docs, dim):
            raise ValueError(
                f"searcher covers {searcher.n_docs} x {searcher.dim} vectors but {what} holds {n_docs} x {dim}: "
                "build it from this index (index.searcher(...))"
            )
    return searcher


class ExactSearcher(Searcher):
    """The exact scan (:func:`~pyterrier_prob.index.exact.search_vectors`) over a ``(n_docs, dim)`` array/memmap;
    ``scale``: an optional per-document factor of the scores (``1 / ||d||`` for cosines of unnormalised vectors)."""

    backend = "exact"

    def __init__(self, vectors: np.ndarray, scale: np.ndarray | None = None) -> None:
        if np.ndim(vectors) != 2:
            raise ValueError(f"vectors must have shape (documents, dim), got {np.shape(vectors)}")
        self.vectors, self.scale = vectors, scale
        self.n_docs, self.dim = (int(x) for x in vectors.shape)

    @property
    def memory_bytes(self) -> int:
        return int(self.vectors.nbytes)

    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits:
        return search_vectors(self.vectors, Q, t, k, scale=self.scale)

    def score(self, Q: np.ndarray, qi: np.ndarray, docids: np.ndarray) -> np.ndarray:
        """The exact scores ``<Q[qi], d_docids>`` (times the scale) of given pairs, e.g. a re-ranker's candidates."""
        return pair_scores(self.vectors, self.scale, Q, qi, docids)


class FaissSearcher(Searcher):
    """A faiss index over the vectors (``docs/scale.md``); :meth:`with_params` gives a copy with other search
    parameters (:data:`SEARCH_PARAMS`, read as attributes: ``searcher.nprobe``) sharing the built index."""

    def __init__(
        self,
        index: Any,
        backend: str,
        settings: SearchSettings | None = None,
        *,
        vectors: np.ndarray | None = None,
        scale: np.ndarray | None = None,
        build_s: float = 0.0,
        memory_bytes: int | None = None,
    ) -> None:
        self.index = self.cpu_index = index
        self._backend = backend
        self.n_docs, self.dim = int(index.ntotal), int(index.d)
        self.vectors, self.scale = vectors, scale
        self.settings = (settings or SearchSettings()).checked(backend, vectors is not None)
        self.last_probes: np.ndarray | None = None  # lists probed per query by the last adaptive range search
        self.build_s = float(build_s)
        self._memory = memory_bytes
        self.on_gpu = False

    def __getattr__(self, name: str) -> Any:  # the search parameters, read-only: searcher.nprobe
        if name in SEARCH_PARAMS and "settings" in self.__dict__:
            return getattr(self.settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def backend(self) -> str:  # type: ignore[override]
        return f"gpu_{self._backend}" if self.on_gpu else self._backend

    @property
    def memory_bytes(self) -> int:
        if self._memory is None:
            self._memory = int(import_faiss().serialize_index(self.cpu_index).nbytes)
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
        out.settings = _settings(self.settings, params, SEARCH_PARAMS).checked(self._backend, self.vectors is not None)
        return out

    def setting(self) -> str:
        """The search parameters, as a short string (``nprobe=64``)."""
        s, ivf = self.settings, self._backend in _IVF
        parts = [
            f"nprobe={self._nprobe()}" if ivf else "",
            f"probe_margin={s.probe_margin:g}" if ivf and s.probe_margin is not None else "",
            f"ef_search={self._ef()}" if self._backend == "hnsw" else "",
            f"range_slack={s.range_slack:g}" if s.range_slack else "",
            f"k_factor={s.k_factor}" if s.k_factor != 1 else "",
        ]
        return ",".join(p for p in parts if p) or "-"

    # ---- parameters ------------------------------------------------------------------------------------------
    def _nprobe(self) -> int:  # the settings' values are positive ints or None
        return int(self.settings.nprobe or self.cpu_index.nprobe)

    def _ef(self) -> int:
        return int(self.settings.ef_search or self.cpu_index.hnsw.efSearch)

    def _apply(self, k: int = 0) -> None:
        if self._backend in _IVF:
            self.index.nprobe = self.cpu_index.nprobe = self._nprobe()
        if self._backend == "hnsw":
            self.cpu_index.hnsw.efSearch = max(self._ef(), k)

    # ---- search ------------------------------------------------------------------------------------------------
    def _knn(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.n_docs)
        self._apply(k)
        index = self.index if not (self.on_gpu and k > _GPU_MAX_K) else self.cpu_index
        found = [index.search(Q[q0 : q0 + _QUERY_BATCH], k) for q0 in range(0, Q.shape[0], _QUERY_BATCH)]
        return np.concatenate([D for D, _ in found]), np.concatenate([ids for _, ids in found])

    def _knn_past_ties(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-NN, deepened (doubling) for the queries whose last neighbour ties with their k-th: faiss keeps an
        arbitrary few of the documents tied at the k-th score, the exact scan (and :meth:`search`) the lower docids."""
        if self.on_gpu and k >= _GPU_MAX_K:  # pragma: no cover - one more would leave the GPU
            return self._knn(Q, k)
        D, ids = self._knn(Q, k + 1)  # one more: does the (k+1)-th tie with the k-th?
        while k < D.shape[1] < self.n_docs:
            tied = np.flatnonzero((ids[:, -1] >= 0) & (D[:, -1] >= D[:, k - 1]))
            if not tied.size:
                break
            Dt, It = self._knn(Q[tied], 2 * D.shape[1])
            pad = ((0, 0), (0, Dt.shape[1] - D.shape[1]))
            D, ids = np.pad(D, pad, constant_values=-np.inf), np.pad(ids, pad, constant_values=-1)
            D[tied], ids[tied] = Dt, It
        return D, ids

    def _finish(
        self, Q: np.ndarray, t: np.ndarray, k: int | None, qi: np.ndarray, docids: np.ndarray, scores: np.ndarray
    ) -> CutoffHits:
        """The candidates (query, docid, approximate score) re-scored if asked, cut at ``t`` and ``k``."""
        keep = docids >= 0
        qi, docids, scores = qi[keep], docids[keep], scores[keep]
        if self.settings.rescore:
            scores = pair_scores(self.vectors, self.scale, Q, qi, docids)
        keep = scores >= f32_ceil(t)[qi]
        return hits_from_pairs(Q.shape[0], qi[keep], docids[keep], scores[keep], k)

    def _search(self, Q: np.ndarray, t: np.ndarray, k: int | None) -> CutoffHits:
        if k is not None:
            if self.settings.rescore:
                D, ids = self._knn(Q, k * self.settings.k_factor)
            else:
                D, ids = self._knn_past_ties(Q, k)
            qi = np.repeat(np.arange(Q.shape[0]), ids.shape[1])
            return self._finish(Q, t, k, qi, ids.reshape(-1), D.reshape(-1))
        if self.on_gpu:  # pragma: no cover - needs faiss-gpu and a GPU (the code path is tested on the CPU)
            return self._gpu_range(Q, t)
        return self._finish(Q, t, None, *self._range_pairs(Q, t))

    def _radius(self, t: np.ndarray) -> np.ndarray:
        """faiss keeps inner products strictly above the radius: one float32 step below each (slackened) t."""
        return np.nextafter(f32_ceil(t - self.settings.range_slack), np.float32(-np.inf))

    def _range_pairs(self, Q: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """faiss range search of the CPU index, per query at its own radius: (query, docid, score) candidates."""
        self._apply()
        radius, index = self._radius(t), self.cpu_index
        if self.settings.probe_margin is not None:
            parts = self._adaptive_range(Q, t, radius)
        else:  # one query per call, each at its own radius, in threads
            with ThreadPoolExecutor(max(1, min(n_threads(), Q.shape[0]))) as pool:
                found = pool.map(lambda i: index.range_search(Q[i : i + 1], float(radius[i])), range(Q.shape[0]))
                parts = [(D, ids) for _, D, ids in found]
        qi = np.repeat(np.arange(Q.shape[0]), [p[1].size for p in parts])
        ids = np.concatenate([p[1] for p in parts]).astype(np.int64)
        return qi, ids, np.concatenate([p[0] for p in parts])

    def _adaptive_range(self, Q: np.ndarray, t: np.ndarray, radius: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """IVF range search probing every list whose centroid scores ``>= t_q - probe_margin`` (at least ``nprobe``)."""
        index = self.cpu_index
        nlist = int(index.nlist)
        Dc, Ic = index.quantizer.search(Q, nlist)
        need = np.maximum((Dc >= (t - self.settings.probe_margin)[:, None]).sum(axis=1), min(self._nprobe(), nlist))
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
        return parts

    def _gpu_range(self, Q: np.ndarray, t: np.ndarray) -> CutoffHits:
        """A range search by k-NN of doubling depth (GPU indexes have none), past ``_GPU_MAX_K`` on the CPU index."""
        radius, todo, found = self._radius(t), np.arange(Q.shape[0]), []
        k = min(64, _GPU_MAX_K)
        while todo.size:
            D, ids = self._knn(Q[todo], k)
            done = (D[:, -1] <= radius[todo]) | (D.shape[1] >= self.n_docs)
            rows, cols = np.nonzero(D[done] > radius[todo[done]][:, None])
            found.append((todo[done][rows], ids[done][rows, cols], D[done][rows, cols]))
            todo = todo[~done]
            if todo.size and k >= _GPU_MAX_K:  # deeper than the GPU can go: the exact range search on the CPU
                q, d, sc = self._range_pairs(Q[todo], t[todo])
                found.append((todo[q], d, sc))
                break
            k = min(2 * k, _GPU_MAX_K)
        return self._finish(Q, t, None, *(np.concatenate(x) for x in zip(*found)))


class ShardedSearcher(Searcher):
    """Several searchers over consecutive row ranges (shard i: rows ``offsets[i]:offsets[i+1]``) as one, of any
    backends: the union of the shards' ``S_{t,K}``, cut at K, is exact whenever each shard's is."""

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
        hits = [shard._search(Q, t, k) for shard in self.shards]  # Q, t and k are checked by search()
        qi = np.concatenate([np.repeat(np.arange(Q.shape[0]), h.counts) for h in hits])
        di = np.concatenate([h.docids + off for h, off in zip(hits, self.offsets[:-1])])
        return hits_from_pairs(Q.shape[0], qi, di, np.concatenate([h.scores for h in hits]), k)


def _build_faiss(vectors: np.ndarray, backend: str, scale: np.ndarray | None, s: SearchSettings, verbose: bool) -> Any:
    faiss = import_faiss()
    (n, d), metric = vectors.shape, faiss.METRIC_INNER_PRODUCT
    qtype = {"fp16": faiss.ScalarQuantizer.QT_fp16, "sq8": faiss.ScalarQuantizer.QT_8bit}.get(backend.split("_")[-1])
    if backend == "flat":
        index = faiss.IndexFlatIP(d)
    elif backend == "flat_fp16":
        index = faiss.IndexScalarQuantizer(d, qtype, metric)
    elif backend == "hnsw":
        index = faiss.IndexHNSWFlat(d, s.M, metric)
        index.hnsw.efConstruction = s.ef_construction
    else:
        quantizer = faiss.IndexFlatIP(d)
        if backend == "ivf_flat":
            index = faiss.IndexIVFFlat(quantizer, d, s.nlist, metric)
        elif qtype is not None:
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, s.nlist, qtype, metric)
        elif d % s.pq_m:
            raise ValueError(f"pq_m={s.pq_m} must divide the dimension {d}")
        else:
            index = faiss.IndexIVFPQ(quantizer, d, s.nlist, s.pq_m, 8, metric)
        index.own_fields = True
        quantizer.this.disown()
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(s.seed).choice(n, size=min(n, s.train_size), replace=False))
        index.train(_rows(vectors, rows, scale))
    # HNSW gets every vector in one add: it inserts an add's vectors level by level in a shuffled order, and added
    # in chunks its graph loses half its recall (docs/scale.md); the other indexes code each vector on its own
    step = max(n, 1) if backend == "hnsw" else _ADD_BATCH
    for a in pt.tqdm(range(0, n, step), desc=f"building {backend}", unit="batch", disable=not verbose):
        index.add(_rows(vectors, slice(a, a + step), scale))
    return index


def _rows(vectors: np.ndarray, rows: Any, scale: np.ndarray | None) -> np.ndarray:
    x = np.ascontiguousarray(np.asarray(vectors[rows], dtype=np.float32))
    return x if scale is None else x * scale[rows][:, None]


def _cached_faiss(
    vectors: np.ndarray, backend: str, scale: np.ndarray | None, s: SearchSettings, path: Path | None, verbose: bool
) -> tuple[Any, float]:
    """The faiss index read from ``path`` (checked against the vectors) or built (and written there, atomically)."""
    faiss = import_faiss()
    n, d = vectors.shape
    if path is not None and path.exists():
        index = faiss.read_index(str(path))
        if index.ntotal != n or index.d != d:
            raise ValueError(
                f"the cached faiss index {str(path)!r} holds {index.ntotal} x {index.d} vectors, not {n} x {d}: "
                "delete it to rebuild"
            )
        meta = path.with_suffix(".build_s")
        return index, float(meta.read_text()) if meta.exists() else float("nan")
    start = time.perf_counter()
    index = _build_faiss(vectors, backend, scale, s, verbose)
    build_s = time.perf_counter() - start
    if path is not None:
        atomic_write(path, lambda f: faiss.write_index(index, faiss.PyCallbackIOWriter(f.write)))
        atomic_write(path.with_suffix(".build_s"), f"{build_s:.3f}\n")
    return index, build_s


def make_searcher(
    vectors: np.ndarray,
    backend: str = "exact",
    *,
    scale: np.ndarray | None = None,
    cache_dir: str | os.PathLike | None = None,
    gpu: bool | None = False,
    verbose: bool = False,
    settings: SearchSettings | None = None,
    **params: Any,
) -> Searcher:
    """A :class:`Searcher` of ``backend`` (:data:`BACKENDS`) over ``vectors`` (``(n_docs, dim)``, any float dtype,
    kept, not copied, for the exact scan and re-scoring).

    Args:
        scale: per-document factor of the scores (``1 / ||d||`` for cosines of unnormalised vectors).
        cache_dir: a folder the built faiss index is kept in (:func:`cache_name`; read back, written atomically).
        gpu: run on the GPU (``None``: when faiss sees one and the backend has a GPU version).
        settings, params: a :class:`SearchSettings` and/or its fields by keyword (``nlist=1024, nprobe=64``).
    """
    choice("backend", backend, BACKENDS)
    if np.ndim(vectors) != 2 or not len(vectors):
        raise ValueError(f"vectors must have shape (documents, dim) with at least one row, got {np.shape(vectors)}")
    s = _settings(settings, params, [f.name for f in dataclasses.fields(SearchSettings)])
    if backend == "exact":
        if gpu:
            raise ValueError("backend='exact' is the CPU reference scan; for a GPU scan use backend='flat', gpu=True")
        return ExactSearcher(vectors, scale)
    s, build = s.with_build_defaults(backend, *vectors.shape)
    path = Path(cache_dir) / cache_name(backend, **build) if cache_dir is not None else None
    index, build_s = _cached_faiss(vectors, backend, scale, s, path, verbose)
    memory = path.stat().st_size if path is not None else None
    out = FaissSearcher(index, backend, s, vectors=vectors, scale=scale, build_s=build_s, memory_bytes=memory)
    if gpu is None:
        faiss = import_faiss()
        gpu = backend != "hnsw" and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    return out.to_gpu() if gpu else out


def cache_name(backend: str, **params: Any) -> str:
    """The file name a faiss index of these build parameters is cached under (``ivf_sq8-nlist1024-seed0-...``)."""
    return backend + "".join(f"-{k}{v}" for k, v in sorted(params.items()) if v is not None) + ".faiss"


def cached_searcher(
    cache: dict, key: tuple, vectors: np.ndarray, backend: str, cache_dir: Path, **params: Any
) -> Searcher:
    """:func:`make_searcher` once per backend, ``gpu`` and build parameters (memoised in ``cache`` under ``key``);
    search parameters of ``params`` give copies sharing it."""
    search = {k: params.pop(k) for k in SEARCH_PARAMS if k in params}
    scale, gpu = params.pop("scale", None), params.pop("gpu", False)
    key = (*key, backend, gpu, tuple(sorted(params.items())))
    if key not in cache:
        cache[key] = make_searcher(vectors, backend, scale=scale, gpu=gpu, cache_dir=cache_dir, **params)
    return cache[key].with_params(**search) if search else cache[key]


def merge_runs(runs: Sequence[pd.DataFrame], num_results: int | None = None) -> pd.DataFrame:
    """Merge result frames retrieved shard by shard (disjoint documents) into one run: each qid's best
    ``num_results`` of their union (``None``: all), by score (ties: docno), ``rank`` from 0 -- the unsharded run."""
    if not len(runs):
        raise ValueError("merge_runs needs at least one run")
    for i, r in enumerate(runs):
        if missing := [c for c in ("qid", "docno", "score") if c not in r.columns]:
            raise ValueError(f"run {i} has no column(s) {missing} (columns: {list(r.columns)})")
    k = positive_int("num_results", num_results, allow_none=True)
    frames = [r.drop(columns=["rank", "docid"], errors="ignore").assign(_shard=i) for i, r in enumerate(runs)]
    allr = pd.concat(frames, ignore_index=True)
    if (dup := allr.duplicated(["qid", "docno"], keep=False)).any():
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
    """A :class:`~pyterrier_prob.index.search.Searcher` over this index's vectors (cosines), for ``searcher=``.

    ``backend``: one of ``BACKENDS``; ``params``: fields of ``SearchSettings`` (``nlist``, ``nprobe``, ...). A faiss
    index is built once, cached in ``faiss/`` here and in memory; search parameters give copies sharing it.
    """
    self.check_finite()
    key, folder = ("pyterrier_prob.searcher",), self.index_path / "faiss"
    return cached_searcher(self._cache, key, self.vectors(), backend, folder, scale=doc_scale(self), gpu=gpu, **params)


DenseIndex.searcher = _dense_searcher
