"""One search layer for every dense retriever: exact, faiss IVF / HNSW / GPU, and shards.

A :class:`Searcher` answers pEBR's ``S_{t,K}(q) = Top_K({d : <q, d> >= t_q})`` (Appendix A) for a batch of queries;
it is the one ``searcher=`` type of pEBR's cutoffs, MoL's candidate stages and UniERF's branches. Build one with
:func:`make_searcher`, ``DenseIndex.searcher(...)`` or ``MoLIndex.searcher(part, ...)``; how each backend searches
and its defaults: ``docs/scale.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.index.backends import SearchSettings, build_index, get, import_faiss, search_params
from pyterrier_prob.index.backends import names as backend_names
from pyterrier_prob.index.backends.base import check_search_params, settings_for
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
from pyterrier_prob.validation import positive_int

__all__ = [
    "BACKENDS",
    "GPU_MAX_K",
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

#: The built-in backends of :func:`make_searcher` (``exact`` and the faiss ones of
#: :mod:`pyterrier_prob.index.backends`; :func:`~pyterrier_prob.index.backends.names` lists those registered since).
BACKENDS = ("exact", *backend_names())
QUERY_BATCH = 256  # queries per faiss k-NN call
GPU_MAX_K = 2048  # faiss GPU k-NN limit: a GPU range search deeper than this goes to the CPU index
#: Search parameters of the built-in backends (:meth:`FaissSearcher.with_params`, ``DenseIndex.searcher``).
SEARCH_PARAMS = search_params()


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
        self._backend, self.impl = backend, get(backend)
        self.n_docs, self.dim = int(index.ntotal), int(index.d)
        self.vectors, self.scale = vectors, scale
        self.settings = self.impl.check(settings_for(self.impl, settings, {}), vectors is not None)
        self.last_probes: np.ndarray | None = None  # lists probed per query by the last adaptive range search
        self.build_s = float(build_s)
        self._memory = memory_bytes
        self.on_gpu = False

    def __getattr__(self, name: str) -> Any:  # the search parameters, read-only: searcher.nprobe
        if "settings" in self.__dict__ and name in self.__dict__["impl"].settings.search_params:
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
        """This searcher on GPU 0 (faiss ``index_cpu_to_gpu``); a backend without a GPU version is a ValueError."""
        faiss = import_faiss()
        if not self.impl.gpu:
            raise ValueError(f"faiss has no GPU version of {self._backend}: use ivf_* or flat on the GPU")
        if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
            raise RuntimeError("no GPU faiss: install pyterrier-prob[gpu] (faiss-gpu) on a machine with a CUDA GPU")
        out = copy.copy(self)
        out._res = faiss.StandardGpuResources()
        out.index = faiss.index_cpu_to_gpu(out._res, 0, self.cpu_index)
        out.on_gpu = True
        return out

    def with_params(self, **params: Any) -> FaissSearcher:
        """A copy with other search parameters (the backend's ``settings.search_params``)."""
        check_search_params(self.impl, params)
        out = copy.copy(self)
        out.settings = self.impl.check(dataclasses.replace(self.settings, **params), self.vectors is not None)
        return out

    def setting(self) -> str:
        """The search parameters, as a short string (``nprobe=64``)."""
        s = self.settings
        parts = [
            *self.impl.describe(self.cpu_index, s),
            f"range_slack={s.range_slack:g}" if s.range_slack else "",
            f"k_factor={s.k_factor}" if s.k_factor != 1 else "",
        ]
        return ",".join(p for p in parts if p) or "-"

    def _apply(self, k: int = 0) -> None:
        self.impl.apply(self.cpu_index, self.settings, k)
        if self.index is not self.cpu_index:  # the GPU copy
            self.impl.apply(self.index, self.settings, k)

    # ---- search ------------------------------------------------------------------------------------------------
    def _knn(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, self.n_docs)
        self._apply(k)
        index = self.index if not (self.on_gpu and k > GPU_MAX_K) else self.cpu_index
        found = [index.search(Q[q0 : q0 + QUERY_BATCH], k) for q0 in range(0, Q.shape[0], QUERY_BATCH)]
        return np.concatenate([D for D, _ in found]), np.concatenate([ids for _, ids in found])

    def _knn_past_ties(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-NN, deepened (doubling) for the queries whose last neighbour ties with their k-th: faiss keeps an
        arbitrary few of the documents tied at the k-th score, the exact scan (and :meth:`search`) the lower docids."""
        if self.on_gpu and k >= GPU_MAX_K:  # pragma: no cover - one more would leave the GPU
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
        """faiss range search of the CPU index, per query at its own radius (or the backend's own range search):
        (query, docid, score) candidates."""
        self._apply()
        radius, index = self._radius(t), self.cpu_index
        parts = self.impl.range_pairs(self, Q, t, radius)
        if parts is None:  # one query per call, each at its own radius, in threads
            with ThreadPoolExecutor(max(1, min(n_threads(), Q.shape[0]))) as pool:
                found = pool.map(lambda i: index.range_search(Q[i : i + 1], float(radius[i])), range(Q.shape[0]))
                parts = [(D, ids) for _, D, ids in found]
        qi = np.repeat(np.arange(Q.shape[0]), [p[1].size for p in parts])
        ids = np.concatenate([p[1] for p in parts]).astype(np.int64)
        return qi, ids, np.concatenate([p[0] for p in parts])

    def _gpu_range(self, Q: np.ndarray, t: np.ndarray) -> CutoffHits:
        """A range search by k-NN of doubling depth (GPU indexes have none), past ``GPU_MAX_K`` on the CPU index."""
        radius, todo, found = self._radius(t), np.arange(Q.shape[0]), []
        k = min(64, GPU_MAX_K)
        while todo.size:
            D, ids = self._knn(Q[todo], k)
            done = (D[:, -1] <= radius[todo]) | (D.shape[1] >= self.n_docs)
            rows, cols = np.nonzero(D[done] > radius[todo[done]][:, None])
            found.append((todo[done][rows], ids[done][rows, cols], D[done][rows, cols]))
            todo = todo[~done]
            if todo.size and k >= GPU_MAX_K:  # deeper than the GPU can go: the exact range search on the CPU
                q, d, sc = self._range_pairs(Q[todo], t[todo])
                found.append((todo[q], d, sc))
                break
            k = min(2 * k, GPU_MAX_K)
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
    index = build_index(vectors, backend, scale, s, verbose)
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
    """A :class:`Searcher` of ``backend`` (``exact`` or a registered faiss backend, :data:`BACKENDS`) over ``vectors``
    (``(n_docs, dim)``, any float dtype, kept, not copied, for the exact scan and re-scoring).

    Args:
        scale: per-document factor of the scores (``1 / ||d||`` for cosines of unnormalised vectors).
        cache_dir: a folder the built faiss index is kept in (:func:`cache_name`; read back, written atomically).
        gpu: run on the GPU (``None``: when faiss sees one and the backend has a GPU version).
        settings, params: the backend's settings (its :class:`SearchSettings` subclass, e.g. ``IVFSettings``) and/or
            their fields by keyword (``nlist=1024, nprobe=64``).
    """
    if np.ndim(vectors) != 2 or not len(vectors):
        raise ValueError(f"vectors must have shape (documents, dim) with at least one row, got {np.shape(vectors)}")
    if backend == "exact":
        if gpu:
            raise ValueError("backend='exact' is the CPU reference scan; for a GPU scan use backend='flat', gpu=True")
        if settings is not None or params:
            raise ValueError(f"the exact backend has no parameters, got {sorted(params) or ['settings']}")
        return ExactSearcher(vectors, scale)
    impl = get(backend)  # a ValueError naming the registered backends
    s, build = impl.with_defaults(settings_for(impl, settings, params), *vectors.shape)
    path = Path(cache_dir) / cache_name(backend, **build) if cache_dir is not None else None
    index, build_s = _cached_faiss(vectors, backend, scale, s, path, verbose)
    memory = path.stat().st_size if path is not None else None
    out = FaissSearcher(index, backend, s, vectors=vectors, scale=scale, build_s=build_s, memory_bytes=memory)
    if gpu is None:
        faiss = import_faiss()
        gpu = impl.gpu and hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
    return out.to_gpu() if gpu else out


def cache_name(backend: str, **params: Any) -> str:
    """The file name a faiss index of these build parameters is cached under (``ivf_sq8-nlist1024-seed0-...``)."""
    return backend + "".join(f"-{k}{v}" for k, v in sorted(params.items()) if v is not None) + ".faiss"


def cached_searcher(
    cache: dict, key: tuple, vectors: np.ndarray, backend: str, cache_dir: Path, **params: Any
) -> Searcher:
    """:func:`make_searcher` once per backend, ``gpu`` and build parameters (memoised in ``cache`` under ``key``);
    search parameters of ``params`` give copies sharing it."""
    names = get(backend).settings.search_params if backend != "exact" else ()
    search = {k: params.pop(k) for k in names if k in params}
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
