"""Mixture-of-Logits top-K retrieval (Sec. 3 of ``shared/papers/mixture-of-logits.txt``): :class:`MoLRetriever`.
phi(q, x) = sum_p pi_p(q, x) <f_pq(q), g_px(x)> (Eqs. 1-2) <= max_p <f_pq(q), g_px(x)> makes Algorithm 1 exact and
bounds Algorithm 2's gap (Theorems 2-3, App. B). How each method and bound works: ``docs/mol.md``."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partialmethod
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyterrier as pt
import torch

from pyterrier_prob.dense import Capped, validate_columns
from pyterrier_prob.index.exact import search_vectors, top_per_query
from pyterrier_prob.index.mol import MoLIndex, as_mol_index
from pyterrier_prob.index.search import GPU_MAX_K, Searcher, check_searcher, import_faiss
from pyterrier_prob.mol.scoring import (
    SCORE_BUDGET,
    IndexDocs,
    MoLReranker,
    check_index_matches,
    device_dtype,
    inference,
    mol_shapes,
    query_rows,
    score_pairs,
    tensor,
)
from pyterrier_prob.validation import check_ids, choice, positive_int

__all__ = ["METHODS", "MoLRetriever", "MoLRunOptions"]

#: The top-K algorithms of Sec. 3 that :class:`MoLRetriever` implements.
METHODS = ("brute_force", "exact", "topk_per_embedding", "topk_avg", "comb_topk")
_PER_EMBEDDING = ("topk_per_embedding", "comb_topk")  # methods with a per-embedding candidate set (N1)
_AVERAGED = ("topk_avg", "comb_topk")  # methods with an averaged-embedding candidate set (N2)

QUERY_BATCH = 256  # queries per block
_RANGE_SLACK = 1e-4  # relative slack of Algorithm 1's range search: float32 MoL scores vs faiss dot products
_SCAN_BUDGET = 1 << 23  # float32 scores of one block of a CPU exhaustive scan (queries x documents), ~32 MiB


def _flat_vectors(index: Any) -> np.ndarray | None:
    """The ``(ntotal, d)`` float32 vectors of a CPU faiss ``IndexFlat`` (a zero-copy view), else ``None``."""
    faiss = import_faiss()
    if not isinstance(index, faiss.IndexFlat) or index.ntotal == 0:
        return None
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def _row_topk(S: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values of ``S`` and their columns, unordered: torch.topk for small k, numpy's linear-time
    ``argpartition`` for deep lists, where a heap-based top-k slows down (TopKAvg, N = 32,000 of a million items)."""
    if k <= 256 or k >= S.shape[1]:
        return torch.topk(S, k, dim=1, sorted=False)
    Sn = S.numpy()
    idx = np.argpartition(Sn, Sn.shape[1] - k, axis=1)[:, Sn.shape[1] - k :]
    return torch.from_numpy(np.take_along_axis(Sn, idx, axis=1)), torch.from_numpy(idx)


def _knn_scan(vectors: np.ndarray, X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exhaustive top-k by inner product, best first: ``(D, I)`` of shape ``(len(X), k)``, k <= len(vectors); torch
    float32 GEMMs over document blocks on the CPU (faiss-cpu scans the vectors once per query below its BLAS
    threshold: slower than blocked GEMMs here)."""
    Xt = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32))
    block = max(1024, _SCAN_BUDGET // max(1, len(X)))
    best_v = best_i = None
    for a in range(0, len(vectors), block):
        S = Xt @ torch.from_numpy(vectors[a : a + block]).T
        v, i = _row_topk(S, min(k, S.shape[1]))
        i = i + a
        if best_v is not None:
            v, j = _row_topk(torch.cat([best_v, v], dim=1), min(k, best_v.shape[1] + v.shape[1]))
            i = torch.gather(torch.cat([best_i, i], dim=1), 1, j)
        best_v, best_i = v, i
    order = torch.argsort(best_v, dim=1, descending=True)
    return torch.gather(best_v, 1, order).numpy(), torch.gather(best_i, 1, order).numpy()


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` by sorting (numpy 2's hash-based unique is many times slower on a million int64 keys)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if a.size else a


def _unique_pairs(qi: np.ndarray, docids: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (query, docid) pairs, sorted by query then docid (faiss' -1 'no result' dropped)."""
    ok = docids >= 0
    key = _sorted_unique(qi[ok].astype(np.int64) * n_docs + docids[ok].astype(np.int64))
    return key // n_docs, key % n_docs


def _part_searchers(index: MoLIndex, searcher: Any, parts: list[int | str]) -> dict[int | str, Searcher] | None:
    """The :class:`~pyterrier_prob.index.search.Searcher` of each part searched (component px or ``"mean"``):
    built by :meth:`MoLIndex.searcher` from ``{"backend": ..., **params}``, or given as ``{part: Searcher}``."""
    if searcher is None:
        return None
    if isinstance(searcher, Mapping) and "backend" in searcher:
        index.searcher("mean", **searcher)  # built (or read from the cache) even where unused: errors here, not mid-run
        return {p: index.searcher(p, **searcher) for p in parts}
    if not isinstance(searcher, Mapping) or not all(isinstance(s, Searcher) for s in searcher.values()):
        raise ValueError(
            "searcher must be a dict with 'backend' and its parameters, e.g. {'backend': 'ivf_flat', 'nlist': 4096, "
            f"'nprobe': 64}}, or {{part: Searcher}} (index.searcher(part, ...)), got {searcher!r}"
        )
    if missing := [p for p in parts if p not in searcher]:
        raise ValueError(
            f"searcher has no Searcher for the parts {missing} this method searches (index.searcher(part))"
        )
    return {p: check_searcher(searcher[p], len(index), index.dim, f"{index!r} (part {p!r})") for p in parts}


class _Block(NamedTuple):
    """A query block's result: selected (query, docid, score, rank), per-query gap bound and counts."""

    qi: np.ndarray
    docids: np.ndarray
    scores: np.ndarray
    rank: np.ndarray
    gap: np.ndarray
    scored: np.ndarray


_NO_BLOCK = _Block(*(np.zeros(0, t) for t in (np.int64, np.int64, np.float32, np.int64, np.float64, np.int64)))


@dataclass(frozen=True)
class MoLRunOptions:
    """How a :class:`MoLRetriever` runs, given to it as keyword arguments: ``count_candidates`` adds
    ``num_candidates`` (items scored with MoL per query); ``batch_size``: queries per block; ``gpu``: faiss on the
    GPU (``None``: when it sees one); ``drop_query_comp``; ``verbose``: a progress bar over query blocks."""

    count_candidates: bool = False
    batch_size: int = QUERY_BATCH
    gpu: bool | None = None
    drop_query_comp: bool = False
    verbose: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_size", positive_int("batch_size", self.batch_size))


class MoLRetriever(Capped):
    """Top-K retrieval with a Mixture-of-Logits similarity from a :class:`~pyterrier_prob.MoLIndex` (Sec. 3).

    Input: ``qid``, ``query_comp`` (``(P_q, d)`` per row, :meth:`MoLEncoder.query_encoder`; plus ``query_feat`` for
    a gate with side features); a qid on several rows must carry the same ``query_comp`` and is retrieved once.
    Output: ``qid, docno, docid, score, rank`` (ties: lower docid first; + ``gap_bound``, ``num_candidates`` when
    asked) and the query columns; ``retriever % k`` folds the cutoff in; a frame with ``docno`` is re-ranked.

    ``mol``'s gate must be a softmax (Algorithm 1 and Theorems 2-3 rely on it). ``method``: one of :data:`METHODS`;
    ``num_results``: K; ``n_per_embedding`` / ``n_avg``: N (N1 / N2 for ``comb_topk``, default K). ``gap_bound``:
    ``"tight"`` (or ``True``) Theorem 2/3's bound per query, ``"loose"`` Appendix B's. ``searcher``: approximate
    candidate searches (Sec. 4), ``{"backend": "ivf_flat", "nlist": 4096, "nprobe": 64}`` (:meth:`MoLIndex.searcher`,
    cached) or ``{part: Searcher}`` (part: component ``px`` or ``"mean"``); ``exact`` stays exact, ``gap_bound`` is
    refused. ``**options``: the fields of :class:`MoLRunOptions`.
    """

    def __init__(
        self,
        index: MoLIndex | str | os.PathLike,
        mol: Any,
        method: str = "exact",
        num_results: int = 1000,
        *,
        n_per_embedding: int | None = None,
        n_avg: int | None = None,
        gap_bound: str | bool | None = None,
        searcher: Mapping[Any, Any] | None = None,
        **options: Any,
    ) -> None:
        self.index = as_mol_index(index)
        self.shapes = mol_shapes(mol)
        check_index_matches(self.index, self.shapes)
        self.mol = mol
        self.method = choice("method", method, METHODS)
        self.num_results = positive_int("num_results", num_results)
        for name, n, methods in (("n_per_embedding", n_per_embedding, _PER_EMBEDDING), ("n_avg", n_avg, _AVERAGED)):
            if n is not None and method not in methods:
                raise ValueError(f"{name} applies to {' and '.join(methods)}, not method={method!r}")
            setattr(self, name, positive_int(name, n, allow_none=True))
        if isinstance(gap_bound, bool):
            gap_bound = "tight" if gap_bound else None
        self.gap_bound = choice("gap_bound", gap_bound, (None, "tight", "loose"))
        if gap_bound == "loose" and method not in _PER_EMBEDDING:
            raise ValueError(
                "gap_bound='loose' (Appendix B) bounds from the per-embedding top N; it applies to "
                f"topk_per_embedding and comb_topk, not method={method!r} (use 'tight')"
            )
        self.options = MoLRunOptions(**options)
        if searcher is not None and gap_bound is not None and method != "exact":
            raise ValueError(
                "gap_bound certifies the top K only over exact candidate searches (Theorems 2-3 need each pair's "
                "true top N): drop searcher= or gap_bound="
            )
        parts: list[int | str] = []  # what the candidate stages search (topk_avg's gap bound: refused above)
        if method in ("exact", *_PER_EMBEDDING):
            parts += range(self.shapes.px)
        if method in _AVERAGED:
            parts.append("mean")
        self.searcher = searcher
        self._searchers = _part_searchers(self.index, searcher, parts)

    @property
    def _n1(self) -> int:
        return self.n_per_embedding or self.num_results

    @property
    def _n2(self) -> int:
        return self.n_avg or self.num_results

    def __repr__(self) -> str:
        names = ("n_per_embedding", "n_avg", "gap_bound", "searcher")
        extra = "".join(f", {n}={getattr(self, n)!r}" for n in names if getattr(self, n) is not None)
        return (
            f"MoLRetriever({self.index!r}, {type(self.mol).__name__}, method={self.method!r}, "
            f"num_results={self.num_results}{extra})"
        )

    def fuse_rank_cutoff(self, k: int) -> MoLRetriever:
        """``retriever % k``: K = min(k, K), candidate depths N kept as they were (the same candidates, so the
        result is this retriever's list cut at k; ``gap_bound`` then bounds the top-k list)."""
        k = positive_int("k", k)
        out = copy.copy(self)
        if self.method in _PER_EMBEDDING:
            out.n_per_embedding = self._n1
        if self.method in _AVERAGED:
            out.n_avg = self._n2
        out.num_results = min(k, self.num_results)
        return out

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        hint = "encode the queries with MoLEncoder(model).query_encoder() >> retriever"
        cols = ["query_comp", "query_feat"] if self.shapes.gate_features else ["query_comp"]
        if validate_columns(self, inp, cols, hint, rerank=None):
            drop = self.options.drop_query_comp
            return MoLReranker(self.index, self.mol, self.num_results, drop_query_comp=drop)(inp)
        inp = inp.reset_index(drop=True)
        blocks = [_NO_BLOCK]
        if len(inp):
            check_ids(inp, ["qid"], type(self).__name__)
            _, first, Q, Qf = query_rows(inp, self.shapes, type(self).__name__)
            inp = inp.iloc[first].reset_index(drop=True)
            self.index.check_finite()
            bs = self.options.batch_size
            quiet = not self.options.verbose or len(Q) <= bs
            starts = pt.tqdm(range(0, len(Q), bs), desc=f"MoL {self.method}", unit="qblock", disable=quiet)
            with inference(self.mol):
                for q0 in starts:
                    blk = self._search_block(Q[q0 : q0 + bs], None if Qf is None else Qf[q0 : q0 + bs])
                    blocks.append(blk._replace(qi=blk.qi + q0))
        blk = _Block(*map(np.concatenate, zip(*blocks)))
        extra: dict[str, Any] = {}
        if self.gap_bound is not None:
            extra["gap_bound"] = blk.gap[blk.qi]
        if self.options.count_candidates:
            extra["num_candidates"] = blk.scored[blk.qi]
        out = inp.iloc[blk.qi].reset_index(drop=True)
        docno = self.index.docno_array()[blk.docids]
        out = out.assign(docno=docno, docid=blk.docids, score=blk.scores, rank=blk.rank, **extra)
        return out.drop(columns="query_comp", errors="ignore") if self.options.drop_query_comp else out

    def _search_block(self, Q: np.ndarray, Qf: np.ndarray | None) -> _Block:
        """Top K of a block of queries ``Q (B, P_q, d)`` (gate features ``Qf``) by the configured method."""
        if self.method == "brute_force":
            return self._brute_force(Q, Qf)
        B, N, K = Q.shape[0], len(self.index), self.num_results
        n1, n2 = self._n1, self._n2
        parts = []  # candidate (query, docid) arrays
        D = nbrs = None
        if self.method in ("exact", *_PER_EMBEDDING) or (self.method == "topk_avg" and self.gap_bound is not None):
            depth = {"exact": K, "topk_per_embedding": n1, "comb_topk": n1, "topk_avg": 0}[self.method]
            search_depth = depth
            if self.gap_bound == "tight" and self.method != "exact":
                search_depth += 1 if self.method == "topk_per_embedding" else n2 + 1
            D, nbrs = self._knn_components(Q, max(search_depth, 1))  # (B, Pq, Px, k)
            if depth:
                ids = nbrs[..., :depth].reshape(B, -1)
                parts.append((np.repeat(np.arange(B), ids.shape[1]), ids.reshape(-1)))
        avg_q = avg_d = None
        if self.method in _AVERAGED:
            _, Im = self._search("mean", Q.mean(axis=1), n2)
            avg_q, avg_d = np.repeat(np.arange(B), Im.shape[1]), Im.reshape(-1)
            parts.append((avg_q, avg_d))
        qi, di = _unique_pairs(*map(np.concatenate, zip(*parts)), N)
        scores = score_pairs(self.mol, self.shapes, Q, Qf, qi, IndexDocs(self.index, di))
        if self.method == "exact":
            qi, di, scores = self._second_pass(Q, Qf, D, qi, di, scores)
        sel, rank = top_per_query(qi, di, scores, K)
        scored = np.bincount(qi, minlength=B)
        gap = np.zeros(B, np.float64)
        if self.gap_bound is not None and self.method != "exact":
            s_k = np.full(B, np.inf)  # the K-th best MoL score returned (the last one when fewer than K)
            np.minimum.at(s_k, qi[sel], scores[sel].astype(np.float64))
            gap = np.maximum(0.0, self._outside_bound(D, nbrs, avg_q, avg_d) - s_k)
        return _Block(qi[sel], di[sel], scores[sel], rank, gap, scored)

    def _outside_bound(self, D: np.ndarray, nbrs: np.ndarray, avg_q: np.ndarray | None, avg_d: np.ndarray | None):
        """Per query, S of Theorem 2 / S' of Theorem 3 (``-inf`` when no item is left outside)."""
        B, n1, n_docs = D.shape[0], self._n1, len(self.index)
        if self.method == "topk_per_embedding" or self.gap_bound == "loose":
            # Theorem 2: the (N+1)-th dot product; loose (App. B): items outside X_{N1,p} score at most the N1-th
            col = n1 if self.gap_bound == "tight" else n1 - 1
            return D[..., col].reshape(B, -1).max(axis=1) if col < D.shape[-1] else np.full(B, -np.inf)
        # Theorem 3: the best dot product of pair p among items outside X_{N1,p} u X'_{N2} (topk_avg: N1 = 0)
        start = 0 if self.method == "topk_avg" else n1
        k = D.shape[-1]
        b = np.arange(B).reshape(B, 1, 1, 1)
        in_avg = np.isin(b * n_docs + nbrs, avg_q.astype(np.int64) * n_docs + avg_d)
        valid = (nbrs >= 0) & ~in_avg & (np.arange(k) >= start)
        return np.where(valid, D, -np.inf).reshape(B, -1).max(axis=1)

    def _second_pass(
        self, Q: np.ndarray, Qf: np.ndarray | None, D: np.ndarray, qi: np.ndarray, di: np.ndarray, scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Algorithm 1 lines 5-12: range search at the K-th best pass-1 MoL score, MoL on the new items."""
        B, K = Q.shape[0], self.num_results
        sel, rank = top_per_query(qi, di, scores, K)
        thresh = np.full(B, -np.inf)
        last = rank == K - 1
        thresh[qi[sel][last]] = scores[sel][last]  # queries with fewer than K candidates already hold every item
        active = np.flatnonzero(np.isfinite(thresh))
        if not active.size:
            return qi, di, scores
        t, Da = thresh[active], D[active].reshape(active.size, -1)
        scale = np.maximum(np.maximum(1.0, np.abs(t)), np.abs(np.where(np.isfinite(Da), Da, 0.0)).max(axis=1))
        radius = np.nextafter((t - _RANGE_SLACK * scale).astype(np.float32), np.float32(-np.inf))
        # every (query, item) with some <f_pq(q), g_px(x)> >= the query's radius: an exact range search per component
        pq, n_docs = self.shapes.pq, len(self.index)
        Qa, row_radius = Q[active].reshape(-1, Q.shape[-1]), np.repeat(radius, pq)
        found = [np.zeros(0, np.int64)]
        for px in range(self.shapes.px):
            hits = search_vectors(_flat_vectors(self.index.faiss_flat(px)), Qa, row_radius, None)
            found.append(active[np.repeat(np.arange(len(Qa)), hits.counts) // pq] * n_docs + hits.docids)
        keys = np.setdiff1d(
            _sorted_unique(np.concatenate(found)), qi.astype(np.int64) * n_docs + di, assume_unique=True
        )
        if keys.size:
            nq, nd = keys // n_docs, keys % n_docs
            ns = score_pairs(self.mol, self.shapes, Q, Qf, nq, IndexDocs(self.index, nd))
            qi, di, scores = np.concatenate([qi, nq]), np.concatenate([di, nd]), np.concatenate([scores, ns])
        return qi, di, scores

    def _search(self, part: int | str, X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """k-NN by inner product over ``part`` (component px or ``"mean"``): the configured searchers, else faiss on
        the GPU (when enabled and k allows) or a blocked torch scan of the faiss flat index's vectors on the CPU;
        ``(D, nbrs)`` of shape ``(len(X), k)``, ``-inf`` / -1 beyond the index."""
        k_eff = min(k, len(self.index))
        if self._searchers is not None:
            hits = self._searchers[part].search(X, -np.inf, k_eff)
            D, nbrs = np.full((len(X), k), -np.inf), np.full((len(X), k), -1, np.int64)
            row = np.repeat(np.arange(len(X)), hits.counts)
            col = np.arange(hits.docids.size) - np.repeat(hits.offsets[:-1], hits.counts)
            D[row, col], nbrs[row, col] = hits.scores, hits.docids
            return D, nbrs
        gpu = self.options.gpu if self.options.gpu is not None else import_faiss().get_num_gpus() > 0
        gpu = bool(gpu) and k_eff <= GPU_MAX_K
        index = self.index.faiss_flat(part, gpu=gpu)
        vectors = None if gpu else _flat_vectors(index)
        if vectors is not None:
            D, nbrs = _knn_scan(vectors, X, k_eff)
        else:
            D, nbrs = index.search(np.ascontiguousarray(X, dtype=np.float32), k_eff)
        pad = ((0, 0), (0, k - k_eff))
        D = np.pad(np.where(nbrs >= 0, D, -np.inf).astype(np.float64), pad, constant_values=-np.inf)
        return D, np.pad(nbrs.astype(np.int64), pad, constant_values=-1)

    def _knn_components(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items of every pair (pq, px): dot products and docids, each ``(B, P_q, P_x, k)``."""
        B, pq, d = Q.shape
        found = [self._search(px, Q.reshape(B * pq, d), k) for px in range(self.shapes.px)]
        return tuple(np.stack([a.reshape(B, pq, k) for a in arrays], axis=2) for arrays in zip(*found))

    def _brute_force(self, Q: np.ndarray, Qf: np.ndarray | None) -> _Block:
        """phi of every (query, item) with ``mol.score_all``, in document chunks, keeping each query's top K."""
        B, N, K = Q.shape[0], len(self.index), self.num_results
        device, dtype = device_dtype(self.mol)
        Qt, Qft = tensor(Q, device, dtype), tensor(Qf, device, dtype)
        comps, feats = self.index.components(), self.index.features()
        per_doc = self.shapes.px * self.shapes.dim + 4 * B * self.shapes.pq * self.shapes.px
        chunk = max(1, SCORE_BUDGET // per_doc)
        parts = [(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32))]  # (query, docid, score)
        pending = 0
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            kwargs = {} if Qft is None else {"q_features": Qft, "x_features": tensor(feats[c0:c1], device, dtype)}
            S = self.mol.score_all(Qt, tensor(comps[c0:c1], device, dtype), **kwargs)
            if tuple(S.shape) != (B, c1 - c0):
                raise ValueError(f"mol.score_all returned shape {tuple(S.shape)}, expected ({B}, {c1 - c0})")
            S = S.float().cpu()
            if not bool(torch.isfinite(S).all()):
                raise ValueError("the MoL produced non-finite scores (nan or inf)")
            # each query's top K of the chunk and every tie of its K-th score: a superset of its part of the top K
            kth = torch.topk(S, min(K, c1 - c0), dim=1).values[:, -1:]
            r, c = torch.nonzero(S >= kth, as_tuple=True)
            parts.append((r.numpy(), c.numpy() + c0, S[r, c].numpy()))
            pending += r.numel()
            if pending > 8 * B * K:
                qi, di, sc = map(np.concatenate, zip(*parts))
                sel, _ = top_per_query(qi, di, sc, K)
                parts, pending = [(qi[sel], di[sel], sc[sel])], sel.size
        qi, di, sc = map(np.concatenate, zip(*parts))
        sel, rank = top_per_query(qi, di, sc, K)
        return _Block(qi[sel], di[sel], sc[sel], rank, np.zeros(B), np.full(B, N, np.int64))


# The index's factories ``index.retriever(mol, ...)`` and ``index.reranker(mol, ...)``, attached here as pyterrier-dr
# attaches its retrievers to FlexIndex, so that the index module never imports the retrieval module (no import
# cycle); ``pyterrier_prob.mol`` always imports this module.
MoLIndex.retriever = partialmethod(MoLRetriever)
MoLIndex.reranker = partialmethod(MoLReranker)
