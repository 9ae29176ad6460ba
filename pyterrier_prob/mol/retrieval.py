"""Mixture-of-Logits (MoL) retrieval for PyTerrier: encoder, top-K retrievers and a re-ranker.

MoL (``shared/papers/mixture-of-logits.txt``) scores a query q and an item x with the learned similarity

    phi(q, x) = sum_p pi_p(q, x) <f_pq(q), g_px(x)>                                          (Eqs. 1, 2)

over the ``P = P_q x P_x`` pairs of the query's P_q and the item's P_x component embeddings, with gating weights
pi(q, x) a softmax (non-negative, summing to one over p). The model side -- the gate, ``score_candidates``,
``score_all`` and ``encode_components`` -- is :mod:`st_extensions.mol`; this module reads what it needs from the
frame (``query_comp``: a ``(P_q, d)`` array per query) and from a :class:`~pyterrier_prob.MoLIndex` (each
document's ``(P_x, d)`` components and their mean), and implements the top-K algorithms of Sec. 3:

* ``brute_force`` -- phi for every (query, item), the reference (Sec. 3.1, first paragraph);
* ``exact`` -- Algorithm 1, two passes. Pass 1: the top K items of every pair's dot product (one faiss
  ``IndexFlatIP`` per item component, searched with all P_q query components), scored with MoL. Pass 2: every
  item with some ``<f_pq(q), g_px(x)> >= S_min`` (a range scan), scored with MoL; the top K of the
  union. Exact because phi is a convex combination of the P dot products, so ``phi(q, x) <= max_p <.,.>``.
  S_min is the K-th best MoL score of pass 1 -- no lower than Algorithm 1's minimum over pass 1 (lines 5-8), so
  pass 2 has no more candidates, and still exact: the true K-th score is at least the K-th score of any subset;
* ``topk_per_embedding`` -- Algorithm 2 with TopKPerEmbedding (lines 4-9): the union of the top N items of
  every pair's dot product, re-scored with MoL (``n_per_embedding`` = N, default K);
* ``topk_avg`` -- Algorithm 2 with TopKAvg (lines 10-13): the top N items by the averaged dot product
  ``<sum_pq f_pq(q), sum_px g_px(x)> / P`` (Eqs. 5-6), searched on the index's precomputed component means,
  re-scored with MoL (``n_avg`` = N). With uniform gating pi_p = 1/P, phi *is* that average, so with N = K this
  returns the exact top K (Sec. 3.2, "Top K average");
* ``comb_topk`` -- Combined top K (Sec. 3.2): the union of both candidate sets (``n_per_embedding`` = N1,
  ``n_avg`` = N2), re-scored with MoL.

MoL scoring is batched in torch on the gate's device (``mol.score_candidates`` on (query, candidate) pairs,
``mol.score_all`` for brute force), under ``torch.inference_mode`` with the module in eval mode. A gate that
also reads side features (App. A.3; ``mol.gate_features``) gets them from the frame (``query_feat``) and the
index (``doc_feat`` at indexing), as :class:`MoLEncoder` writes them. faiss searches on the GPU when it sees one
(k-NN only: faiss' GPU flat indexes have no range search, so Algorithm 1's second pass stays on the CPU). On the
CPU, the k-NN and range scans run as blocked GEMMs in torch over the vectors of the index's faiss flat indexes
(faiss-cpu scans the vectors once per query below its BLAS threshold, memory-bound for a block of queries).

Gap bounds (``gap_bound=...``): Definition 2's gap S_Delta between the approximate and the exact top K is
bounded per query by Theorem 2 (TopKPerEmbedding: ``S - S_K``, S the largest (N+1)-th dot product over the P
pairs, S_K the K-th best MoL score retrieved) and Theorem 3 (Combined top K: ``S' - S_K``, S' the largest dot
product, over the pairs p, of an item outside ``X_{N1,p} u X'_{N2}``; TopKAvg alone is its case N1 = 0).
``gap_bound="tight"`` computes these (searching one extra item per pair, or N1 + N2 + 1 per pair for Theorem 3);
``gap_bound="loose"`` is Appendix B's looser bound from the retrieved items alone (S = the largest N-th dot
product, no extra search; per-embedding methods only). The column ``gap_bound`` holds ``max(0, bound)``:
0 certifies that the returned list is the exact top K (up to ties); ``exact``/``brute_force`` always give 0.
Both theorems hold because pi is a probability distribution (so phi <= max_p <.,.>); so does the exactness of
Algorithm 1.

Outputs follow the cutoff retrievers of :mod:`pyterrier_prob.pebr.cutoff`: ``qid, docno, docid, score, rank`` (rank
from 0; ties broken by lower docid) plus the query columns, ``retriever % k`` folds the cutoff into retrieval
(:meth:`MoLRetriever.fuse_rank_cutoff`), and an empty input gives an empty frame with those columns. Given a
candidate frame (with ``docno``), :class:`MoLRetriever` re-ranks it like :class:`MoLReranker`.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
import torch

from pyterrier_prob.index.mol import MoLIndex, as_mol_index
from pyterrier_prob.index.search import import_faiss
from pyterrier_prob.validation import (
    check_ids,
    check_rows_match_query,
    check_texts,
    first_rows,
    row_namer,
    stack_arrays,
    unique_texts,
)

__all__ = [
    "METHODS",
    "MoLDocEncoder",
    "MoLEncoder",
    "MoLIndex",
    "MoLQueryEncoder",
    "MoLReranker",
    "MoLRetriever",
]

#: The top-K algorithms of Sec. 3 that :class:`MoLRetriever` implements.
METHODS = ("brute_force", "exact", "topk_per_embedding", "topk_avg", "comb_topk")

QUERY_BATCH = 256  # queries per block
_SCORE_BUDGET = 1 << 23  # float32 elements of one MoL scoring chunk (components + gate inputs), ~32 MiB
_RANGE_SLACK = 1e-4  # relative slack of Algorithm 1's range search: float32 MoL scores vs faiss dot products
_GPU_MAX_K = 2048  # faiss GPU k-NN limit; deeper searches run on the CPU index
_SCAN_BUDGET = 1 << 23  # float32 scores of one block of a CPU exhaustive scan (queries x documents), ~32 MiB


# --------------------------------------------------------------------------------------------------------
# the MoL side: shapes, device, scoring
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shapes:
    pq: int  # P_q, query components
    px: int  # P_x, document components
    dim: int  # d
    gate_features: bool = False  # the gate also reads query/document features (App. A.3)
    feature_dim: int | None = None  # their dimension, when the MoL tells


def _mol_shapes(mol: Any) -> _Shapes:
    """P_q, P_x and d of a MixtureOfLogits-like object, with a clear error when it is not one."""
    missing = [m for m in ("score_candidates", "score_all") if not callable(getattr(mol, m, None))]
    if missing:
        raise TypeError(
            f"mol must be a MixtureOfLogits-like module (st_extensions.mol.find_mol(model)) with score_candidates "
            f"and score_all; {type(mol).__name__} lacks {missing}"
        )
    vals = []
    for attr in ("num_query_components", "num_doc_components", "component_dim"):
        v = getattr(mol, attr, None)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise TypeError(f"mol.{attr} must be a positive int, got {v!r} ({type(mol).__name__})")
        vals.append(int(v))
    gate_features = bool(getattr(mol, "gate_features", False))
    fdim = getattr(mol, "embedding_dim", None) if gate_features else None
    if fdim is not None and (isinstance(fdim, bool) or not isinstance(fdim, numbers.Integral) or fdim < 1):
        fdim = None
    return _Shapes(*vals, gate_features=gate_features, feature_dim=None if fdim is None else int(fdim))


def _device_dtype(mol: Any) -> tuple[torch.device, torch.dtype]:
    for getter in ("parameters", "buffers"):
        try:
            t = next(getattr(mol, getter)())
        except (AttributeError, StopIteration, TypeError):
            continue
        return t.device, (t.dtype if t.is_floating_point() else torch.float32)
    return torch.device("cpu"), torch.float32


@contextmanager
def _inference(mol: Any):
    """``torch.inference_mode`` with ``mol`` in eval mode (its previous mode restored afterwards)."""
    training = getattr(mol, "training", None)
    if training and callable(getattr(mol, "eval", None)):
        mol.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if training and callable(getattr(mol, "train", None)):
            mol.train(True)


def _components_matrix(
    values: Sequence[Any],
    rows: int,
    dim: int,
    column: str,
    role: str,
    name: Callable[[int], str] | None = None,
    owner: str = "MoL",
) -> np.ndarray:
    """Stack per-row component arrays into float32 ``(n, rows, dim)``, with clear errors (naming the row) for
    missing, textual, non-numeric, misshapen or non-finite values."""
    name = name or (lambda i: f"row {i}")
    out = stack_arrays(values, column, name, owner, ndim=2, kind="component shapes")
    if len(out) and out.shape[1] != rows:
        raise ValueError(
            f"{column} of {name(0)} has {out.shape[1]} component embeddings, the MoL expects {rows} per {role} "
            f"(P_{'q' if role == 'query' else 'x'}); were they encoded by the same model?"
        )
    if len(out) and out.shape[2] != dim:
        raise ValueError(
            f"dimension mismatch: {column} of {name(0)} has {out.shape[2]}-dim components, the MoL (and index) "
            f"use {dim}-dim ones; were they encoded by the same model?"
        )
    return out if len(out) else np.zeros((0, rows, dim), np.float32)


def _features_matrix(
    values: Sequence[Any],
    fdim: int | None,
    column: str,
    name: Callable[[int], str] | None = None,
    owner: str = "MoL",
) -> np.ndarray:
    """Stack per-row gate feature vectors into float32 ``(n, F)`` (F checked against the MoL when it tells)."""
    name = name or (lambda i: f"row {i}")
    out = stack_arrays(values, column, name, owner, ndim=1, kind=f"{column} dimensions")
    if not len(out):
        return np.zeros((0, fdim or 0), np.float32)
    if fdim is not None and out.shape[1] != fdim:
        raise ValueError(f"dimension mismatch: {column} has {out.shape[1]} dims, the MoL gate reads {fdim}")
    return out


def _gather(arr: np.ndarray, docids: np.ndarray) -> np.ndarray:
    """``arr[docids]`` read in sorted order (memmap-friendly)."""
    uniq, inv = np.unique(docids, return_inverse=True)
    return np.asarray(arr[uniq])[inv.reshape(-1)]


def _flat_vectors(index: Any) -> np.ndarray | None:
    """The ``(ntotal, d)`` float32 vectors of a CPU faiss ``IndexFlat`` (a zero-copy view), else ``None``."""
    faiss = import_faiss()

    if not isinstance(index, faiss.IndexFlat) or index.ntotal == 0:
        return None
    return faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d).reshape(index.ntotal, index.d)


def _scan_blocks(vectors: np.ndarray, X: np.ndarray):
    """``(start, X @ vectors[start:start + block].T)`` over document blocks, as torch float32 on the CPU.

    faiss-cpu's flat search scans the vectors once per query below its BLAS threshold (memory-bound for the
    few hundred query vectors of a block), so CPU exhaustive scans are blocked GEMMs in torch instead.
    """
    Xt = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float32))
    block = max(1024, _SCAN_BUDGET // max(1, len(X)))
    for a in range(0, len(vectors), block):
        yield a, Xt @ torch.from_numpy(vectors[a : a + block]).T


def _row_topk(S: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values of ``S`` and their columns, in no particular order (k <= S.shape[1]).

    torch.topk for small k; numpy's introselect (``argpartition``, linear time) for deep candidate lists,
    where a heap-based top-k slows down (a TopKAvg with N = 32,000 over a million items)."""
    if k <= 256 or k >= S.shape[1]:
        return torch.topk(S, k, dim=1, sorted=False)
    Sn = S.numpy()
    idx = np.argpartition(Sn, Sn.shape[1] - k, axis=1)[:, Sn.shape[1] - k :]
    return torch.from_numpy(np.take_along_axis(Sn, idx, axis=1)), torch.from_numpy(idx)


def _knn_scan(vectors: np.ndarray, X: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exhaustive top-k by inner product, best first: ``(D, I)`` of shape ``(len(X), k)``, k <= len(vectors)."""
    best_v = best_i = None
    for a, S in _scan_blocks(vectors, X):
        v, i = _row_topk(S, min(k, S.shape[1]))
        i = i + a
        if best_v is not None:
            v, j = _row_topk(torch.cat([best_v, v], dim=1), min(k, best_v.shape[1] + v.shape[1]))
            i = torch.gather(torch.cat([best_i, i], dim=1), 1, j)
        best_v, best_i = v, i
    order = torch.argsort(best_v, dim=1, descending=True)
    return torch.gather(best_v, 1, order).numpy(), torch.gather(best_i, 1, order).numpy()


#: ``docs(a, b)`` -> the components ``(b - a, P_x, d)`` and gate features ``(b - a, F)`` (or None) of pairs a..b.
_DocSource = Callable[[int, int], "tuple[np.ndarray, np.ndarray | None]"]


def _index_docs(index: MoLIndex, docids: np.ndarray) -> _DocSource:
    comps, feats = index.components(), index.features()

    def docs(a: int, b: int) -> tuple[np.ndarray, np.ndarray | None]:
        out = (_gather(comps, docids[a:b]), None if feats is None else _gather(feats, docids[a:b]))
        for name, arr in zip(("comps.f4", "feats.f4"), out):
            if arr is not None and not np.isfinite(arr).all():  # a corrupt index file: name it and the document
                d = int(docids[a:b][np.flatnonzero(~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1))[0]])
                raise ValueError(
                    f"{str(index.index_path / name)!r} is corrupt: row {d} (docno {str(index.docno_array()[d])!r}) "
                    "has non-finite values (nan or inf); rebuild the index"
                )
        return out

    return docs


def _tensor(a: np.ndarray | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    if a is None:
        return None
    return torch.from_numpy(np.require(a, np.float32, ["C", "W"])).to(device=device, dtype=dtype)


def _candidate_scorer(mol: Any) -> Callable[..., torch.Tensor]:
    """``mol.score_candidates``, or ``mol.mixture(..., check_finite=False)`` where the MoL has it: the query
    components and features are checked here and the index's at indexing, so the module need not re-scan every
    (query, candidate) row for nan/inf (the scores are checked afterwards either way)."""
    mixture = getattr(mol, "mixture", None)
    if callable(mixture):
        try:
            takes_flag = "check_finite" in inspect.signature(mixture).parameters
        except (TypeError, ValueError):
            takes_flag = False
        if takes_flag:
            return lambda q, x, **kw: mixture(q, x, check_finite=False, **kw)[0]
    return mol.score_candidates


def _score_pairs(
    mol: Any,
    shapes: _Shapes,
    Q: np.ndarray,
    Qf: np.ndarray | None,
    qi: np.ndarray,
    docs: _DocSource,
) -> np.ndarray:
    """phi (Eq. 1) of (query ``qi[i]``, document i) pairs, via ``mol.score_candidates``.

    With ``qi`` grouped by query (non-decreasing, as the retriever's candidate sets are), each query's
    candidates are one row of the batch (``q (n, P_q, d)``, ``x (n, C, P_x, d)``, zero-padded to the longest row
    of the chunk; a query with more candidates than fit in a chunk is split over several rows), so the query
    components are not repeated per candidate and the component dot products are batched matrix products.
    Otherwise each pair is one row with one candidate. Chunks hold at most ``_SCORE_BUDGET`` elements. Gate
    features (``Qf (B, F)`` and the documents') are passed on as ``q_features`` / ``x_features`` when given.
    """
    m_total = qi.size
    out = np.empty(m_total, np.float32)
    if not m_total:
        return out
    device, dtype = _device_dtype(mol)
    Qt = _tensor(Q, device, dtype)
    Qft = _tensor(Qf, device, dtype)
    score = _candidate_scorer(mol)
    if m_total > 1 and bool((qi[1:] < qi[:-1]).any()):
        per_pair = (shapes.pq + shapes.px) * shapes.dim + 4 * shapes.pq * shapes.px + 2 * (shapes.feature_dim or 0)
        chunk = max(1, _SCORE_BUDGET // per_pair)
        for a in range(0, m_total, chunk):
            b = min(m_total, a + chunk)
            comps, feats = docs(a, b)
            x = _tensor(comps, device, dtype)
            rows = torch.from_numpy(qi[a:b]).to(device)
            kwargs = {}
            if Qft is not None or feats is not None:
                kwargs = {"q_features": Qft[rows], "x_features": _tensor(feats, device, dtype)[:, None]}
            s = score(Qt[rows], x[:, None], **kwargs)
            if tuple(s.shape) != (b - a, 1):
                raise ValueError(f"mol.score_candidates returned shape {tuple(s.shape)}, expected ({b - a}, 1)")
            out[a:b] = s.reshape(-1).float().cpu().numpy()
    else:
        cap = max(1, _SCORE_BUDGET // (shapes.px * shapes.dim + 4 * shapes.pq * shapes.px + (shapes.feature_dim or 0)))
        runs = np.flatnonzero(np.r_[True, qi[1:] != qi[:-1]])
        seg_start = np.concatenate([np.arange(r0, r1, cap) for r0, r1 in zip(runs, np.r_[runs[1:], m_total])])
        seg_stop = np.minimum(np.r_[seg_start[1:], m_total], seg_start + cap)
        seg_len = seg_stop - seg_start
        i = 0
        while i < seg_start.size:  # pack consecutive rows while rows x longest row fits the budget
            j, width = i + 1, int(seg_len[i])
            while j < seg_start.size and (j - i + 1) * max(width, int(seg_len[j])) <= cap:
                width = max(width, int(seg_len[j]))
                j += 1
            a, b = int(seg_start[i]), int(seg_stop[j - 1])
            row = torch.from_numpy(np.repeat(np.arange(j - i), seg_len[i:j])).to(device)
            pos = torch.from_numpy(np.arange(a, b) - np.repeat(seg_start[i:j], seg_len[i:j])).to(device)
            comps, feats = docs(a, b)
            full = bool((seg_len[i:j] == width).all())  # no padding: the chunk is a (rows, width) block
            if full:
                x = _tensor(comps, device, dtype).reshape(j - i, width, shapes.px, shapes.dim)
            else:
                x = torch.zeros((j - i, width, shapes.px, shapes.dim), device=device, dtype=dtype)
                x[row, pos] = _tensor(comps, device, dtype)
            qrows = torch.from_numpy(qi[seg_start[i:j]]).to(device)
            kwargs = {}
            if Qft is not None or feats is not None:
                xf = _tensor(feats, device, dtype)
                if full:
                    xfp = xf.reshape(j - i, width, xf.shape[-1])
                else:
                    xfp = torch.zeros((j - i, width, xf.shape[-1]), device=device, dtype=dtype)
                    xfp[row, pos] = xf
                kwargs = {"q_features": Qft[qrows], "x_features": xfp}
            s = score(Qt[qrows], x, **kwargs)
            if tuple(s.shape) != (j - i, width):
                raise ValueError(f"mol.score_candidates returned shape {tuple(s.shape)}, expected ({j - i}, {width})")
            out[a:b] = s[row, pos].float().cpu().numpy()
            i = j
    if not np.isfinite(out).all():
        raise ValueError("the MoL produced non-finite scores (nan or inf)")
    return out


# --------------------------------------------------------------------------------------------------------
# candidate sets (CSR-like: parallel arrays of query, docid, score) and top-K selection
# --------------------------------------------------------------------------------------------------------


def _topk(qi: np.ndarray, docids: np.ndarray, scores: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Indices of each query's k best candidates, grouped by query, best first (ties: lower docid), and ranks."""
    order = np.lexsort((docids, -scores, qi))
    q = qi[order]
    if not q.size:
        return order, np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    rank = np.arange(q.size, dtype=np.int64) - np.repeat(starts, np.diff(np.r_[starts, q.size]))
    if k is None:
        return order, rank
    keep = rank < k
    return order[keep], rank[keep]


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique(a)`` by sorting (numpy 2's hash-based unique is many times slower on a million int64 keys)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if a.size else a


def _unique_pairs(qi: np.ndarray, docids: np.ndarray, n_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (query, docid) pairs, sorted by query then docid (faiss' -1 'no result' dropped)."""
    ok = docids >= 0
    key = _sorted_unique(qi[ok].astype(np.int64) * n_docs + docids[ok].astype(np.int64))
    return key // n_docs, key % n_docs


def _check_pos_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def _validate_columns(owner: pt.Transformer, inp: pd.DataFrame, cols: list[str], hint: str, rerank: bool | None):
    """pt.validate with a message naming what is missing and how to get it; True for a candidate frame."""
    try:
        with pt.validate.any(inp) as v:
            if rerank is not True:
                v.query_frame(extra_columns=cols, mode="retrieve")
            if rerank is not False:
                v.result_frame(extra_columns=cols, mode="rerank")
    except pt.validate.InputValidationError as e:
        missing = sorted({c for m in e.modes for c in m.missing_columns if rerank is not None or c != "docno"})
        need = ["qid", *cols] if rerank is not True else ["qid", "docno", *cols]
        extra = " (plus docno to re-rank)" if rerank is None else ""
        raise pt.validate.InputValidationError(
            f"{type(owner).__name__} needs columns {need}{extra}; missing {missing}: {hint}.", e.modes
        ) from e
    return v.mode == "rerank"


# --------------------------------------------------------------------------------------------------------
# encoder
# --------------------------------------------------------------------------------------------------------


def _mol_module() -> Any:
    try:
        mol_module = importlib.import_module("st_extensions.mol")
    except ImportError as e:  # pragma: no cover - until st_extensions.mol exists
        raise ImportError(
            "MoL encoding needs st_extensions.mol (encode_components / find_mol), which could not be imported"
        ) from e
    return mol_module


class MoLEncoder:
    """Encodes queries and documents into MoL component embeddings (a transformer factory).

    * :meth:`query_encoder`: ``(qid, query)`` -> adds ``query_comp``, a float32 ``(P_q, d)`` array per row;
    * :meth:`doc_encoder`: ``(docno, text)`` -> adds ``doc_comp``, a float32 ``(P_x, d)`` array per row;
    * for a gate that also reads side features (App. A.3, ``gate_features=True``) they add ``query_feat`` /
      ``doc_feat`` too (the model's pooled embeddings), which the index, retriever and re-ranker pass on;
    * :meth:`text_scorer`: re-ranks ``(qid, query, docno, text)`` candidates by encoding both sides and scoring
      them with the model's MoL (``query_encoder() >> doc_encoder() >> MoLReranker(None, mol)``).

    Both encoders call :func:`st_extensions.mol.encode_components` (L2-normalised components, Eq. 2); identical
    texts are encoded once. :attr:`mol` is the model's gating module (:func:`st_extensions.mol.find_mol`), what
    :class:`MoLRetriever` and :class:`MoLReranker` score with.

    Example::

        encoder = MoLEncoder(model)
        index = (encoder.doc_encoder() >> MoLIndex("docs.mol").indexer()).index(dataset.get_corpus_iter())
        pipeline = encoder.query_encoder() >> MoLRetriever(index, encoder.mol, method="exact", num_results=100)

    Args:
        model: a SentenceTransformer with a MoL module, or a path to one (:func:`st_extensions.load_model`).
        batch_size: encoding batch size.
        text_field: the document column to encode.
        verbose: progress bars while encoding.
    """

    def __init__(self, model: Any, batch_size: int = 32, text_field: str = "text", verbose: bool = False) -> None:
        if isinstance(model, (str, os.PathLike)):
            from st_extensions import load_model

            model = load_model(str(model))
        self.model = model
        self.batch_size = _check_pos_int("batch_size", batch_size)
        self.text_field = text_field
        self.verbose = bool(verbose)
        self._gate_features: bool | None = None

    @property
    def mol(self) -> Any:
        """The model's MixtureOfLogits module (:func:`st_extensions.mol.find_mol`)."""
        return _mol_module().find_mol(self.model)

    @property
    def gate_features(self) -> bool:
        """Whether the MoL gate also reads query/document features (App. A.3): the encoders then add them."""
        if self._gate_features is None:
            self._gate_features = bool(getattr(self.mol, "gate_features", False))
        return self._gate_features

    def encode_with_features(
        self, texts: Sequence[str], task: str, batch_size: int | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(components (n, P, d), gate features (n, F) or None)`` of ``texts`` for ``task`` (query/document)."""
        if isinstance(texts, str):
            raise TypeError(f"expected a list of texts, got a single str {texts[:40]!r}")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise ValueError(f"texts[{i}] is {t!r} ({type(t).__name__}), not a str: every text must be a str")
        bs = batch_size or self.batch_size
        encode = _mol_module().encode_components
        feats = None
        if self.gate_features:
            arr, feats = encode(self.model, texts, task=task, batch_size=bs, return_features=True)
            feats = np.asarray(feats, dtype=np.float32)
        else:
            arr = encode(self.model, texts, task=task, batch_size=bs)
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim != 3 or arr.shape[0] != len(texts):
            raise ValueError(
                f"encode_components returned shape {arr.shape} for {len(texts)} texts, expected (n, components, dim)"
            )
        return arr, feats

    def encode_queries(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Query component embeddings ``f_pq(q)``, float32 ``(Q, P_q, d)``."""
        return self.encode_with_features(texts, "query", batch_size)[0]

    def encode_docs(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Document component embeddings ``g_px(x)``, float32 ``(N, P_x, d)``."""
        return self.encode_with_features(texts, "document", batch_size)[0]

    def query_encoder(self, batch_size: int | None = None) -> MoLQueryEncoder:
        """Transformer adding ``query_comp`` to a query frame."""
        return MoLQueryEncoder(self, batch_size=batch_size)

    def doc_encoder(self, batch_size: int | None = None) -> MoLDocEncoder:
        """Transformer adding ``doc_comp`` to a document (or candidate) frame."""
        return MoLDocEncoder(self, batch_size=batch_size)

    def text_scorer(self, num_results: int | None = None, batch_size: int | None = None) -> pt.Transformer:
        """Re-ranks candidates with text by MoL: ``bm25 % 100 >> pt.text.get_text(...) >> encoder.text_scorer()``."""
        return (
            self.query_encoder(batch_size)
            >> self.doc_encoder(batch_size)
            >> MoLReranker(None, self.mol, num_results=num_results, drop_doc_comp=True)
        )

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "model_card_data", None), "base_model", None) or type(self.model).__name__
        return f"MoLEncoder({name!r})"


class MoLQueryEncoder(pt.Transformer):
    """``(qid, query)`` -> adds ``query_comp`` (``(P_q, d)`` float32 per row); made by
    :meth:`MoLEncoder.query_encoder`."""

    def __init__(self, encoder: MoLEncoder, batch_size: int | None = None) -> None:
        self.encoder = encoder
        self.batch_size = _check_pos_int("batch_size", batch_size, allow_none=True) or encoder.batch_size

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pt.validate.any(inp) as v:
            v.query_frame(extra_columns=["query"])
            v.columns(includes=["query"])
        if not len(inp):
            feat = {"query_feat": pd.Series(dtype=object)} if self.encoder.gate_features else {}
            return inp.assign(query_comp=pd.Series(dtype=object), **feat)
        check_ids(inp, ["qid"], "MoLQueryEncoder")
        texts, inv = unique_texts(check_texts(inp, "query", "MoLQueryEncoder"))
        comps, feats = self.encoder.encode_with_features(texts, "query", batch_size=self.batch_size)
        comps = list(comps)  # rows of one text share one array object (compared by identity first downstream)
        feat = {}
        if feats is not None:
            feats = list(feats)
            feat = {"query_feat": [feats[i] for i in inv]}
        return inp.assign(query_comp=[comps[i] for i in inv], **feat)

    def __repr__(self) -> str:
        return f"{self.encoder!r}.query_encoder()"

    def subtransformers(self) -> dict:
        return {}


class MoLDocEncoder(pt.Transformer):
    """``(docno, text)`` -> adds ``doc_comp`` (``(P_x, d)`` float32 per row); made by
    :meth:`MoLEncoder.doc_encoder`. Works on candidate frames too (each distinct text is encoded once)."""

    def __init__(self, encoder: MoLEncoder, batch_size: int | None = None) -> None:
        self.encoder = encoder
        self.batch_size = _check_pos_int("batch_size", batch_size, allow_none=True) or encoder.batch_size
        self.text_field = encoder.text_field

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pt.validate.any(inp) as v:
            v.document_frame(extra_columns=[self.text_field])
            v.columns(includes=[self.text_field])
        if not len(inp):
            feat = {"doc_feat": pd.Series(dtype=object)} if self.encoder.gate_features else {}
            return inp.assign(doc_comp=pd.Series(dtype=object), **feat)
        texts, inv = unique_texts(check_texts(inp, self.text_field, "MoLDocEncoder"))
        comps, feats = self.encoder.encode_with_features(texts, "document", batch_size=self.batch_size)
        feat = {} if feats is None else {"doc_feat": [feats[i] for i in inv]}
        return inp.assign(doc_comp=[comps[i] for i in inv], **feat)

    def fuse_rank_cutoff(self, k: int) -> pt.Transformer:
        return pt.RankCutoff(k) >> self

    def __repr__(self) -> str:
        return f"{self.encoder!r}.doc_encoder()"

    def subtransformers(self) -> dict:
        return {}


# --------------------------------------------------------------------------------------------------------
# re-ranker
# --------------------------------------------------------------------------------------------------------


class MoLReranker(pt.Transformer):
    """Re-scores candidates (``qid, docno, query_comp``) with MoL's phi (Eq. 1) and re-ranks them.

    Where the document components come from -- the re-ranker never calls a model (encoders and scorers stay
    separate pieces, as elsewhere in pyterrier-prob):

    * ``index`` a :class:`~pyterrier_prob.MoLIndex` (or its path): looked up by ``docno``
      (``bm25 % 100 >> encoder.query_encoder() >> MoLReranker(index, encoder.mol)``);
    * ``index=None``: read from the frame's ``doc_comp`` column, as :meth:`MoLEncoder.doc_encoder` adds it
      (``bm25 % 100 >> pt.text.get_text(ds, "text") >> encoder.query_encoder() >> encoder.doc_encoder() >>
      MoLReranker(None, encoder.mol)``, which is what :meth:`MoLEncoder.text_scorer` builds).

    Output: the input rows (``score``/``rank`` replaced), each query's best first (ties keep the input order),
    at most ``num_results`` per query (``None``: all).

    Args:
        index: a :class:`~pyterrier_prob.MoLIndex`, its path, or ``None`` (components from ``doc_comp``).
        mol: the MixtureOfLogits module (:attr:`MoLEncoder.mol`).
        num_results: candidates kept per query (``None``: all); ``reranker % k`` sets it.
        drop_query_comp / drop_doc_comp: drop those columns from the output.

    A gate with side features (``mol.gate_features``) also needs ``query_feat`` (and, without an index,
    ``doc_feat``; with one, the index's stored features), as :class:`MoLEncoder` adds them.
    """

    def __init__(
        self,
        index: MoLIndex | str | os.PathLike | None,
        mol: Any,
        num_results: int | None = None,
        drop_query_comp: bool = False,
        drop_doc_comp: bool = False,
    ) -> None:
        self.shapes = _mol_shapes(mol)
        self.index = None if index is None else as_mol_index(index)
        if self.index is not None:
            _check_index_matches(self.index, self.shapes)
        self.mol = mol
        self.num_results = _check_pos_int("num_results", num_results, allow_none=True)
        self.drop_query_comp = bool(drop_query_comp)
        self.drop_doc_comp = bool(drop_doc_comp)

    def _columns(self) -> list[str]:
        cols = ["query_comp"] if self.index is not None else ["query_comp", "doc_comp"]
        if self.shapes.gate_features:
            cols += ["query_feat"] if self.index is not None else ["query_feat", "doc_feat"]
        return cols

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        hint = "encode the queries with MoLEncoder(model).query_encoder()"
        if self.index is None:
            hint += " and the documents with MoLEncoder(model).doc_encoder() (or pass a MoLIndex)"
        _validate_columns(self, inp, self._columns(), hint, rerank=True)
        inp = inp.reset_index(drop=True)
        base = inp.drop(columns=[c for c in ("score", "rank") if c in inp.columns])
        if len(inp):
            owner = type(self).__name__
            check_ids(inp, ["qid", "docno"], owner)
            codes, first = first_rows(inp["qid"])
            Q, Qf = _query_side(inp, first, self.shapes, owner)
            check_rows_match_query(inp, codes, first, "query_comp", Q, owner, ndim=2)
            if Qf is not None:
                check_rows_match_query(inp, codes, first, "query_feat", Qf, owner)
            if self.index is not None:
                docids = self.index.docids_of(inp["docno"].astype(str).to_numpy())
                if (docids < 0).any():
                    bad = inp["docno"].to_numpy()[docids < 0]
                    raise ValueError(
                        f"{int((docids < 0).sum())} candidate docno(s) are not in {self.index!r} (e.g. "
                        f"{list(bad[:3])}): re-ranking from an index needs the candidates' components in it "
                        "(or use MoLReranker(None, mol) after MoLEncoder(model).doc_encoder())"
                    )
                docs = _index_docs(self.index, docids)
            else:
                name = row_namer(inp)
                X = _components_matrix(
                    inp["doc_comp"].to_numpy(), self.shapes.px, self.shapes.dim, "doc_comp", "doc", name, owner
                )
                Xf = None
                if self.shapes.gate_features:
                    Xf = _features_matrix(inp["doc_feat"].to_numpy(), self.shapes.feature_dim, "doc_feat", name, owner)

                def docs(a: int, b: int) -> tuple[np.ndarray, np.ndarray | None]:
                    return X[a:b], None if Xf is None else Xf[a:b]

            with _inference(self.mol):
                scores = _score_pairs(self.mol, self.shapes, Q, Qf, codes.astype(np.int64), docs)
            order = np.lexsort((-scores, codes))  # stable: ties keep the input order
            c = codes[order]
            counts = np.bincount(c, minlength=len(first))
            rank = np.arange(order.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            if self.num_results is not None:
                keep = rank < self.num_results
                order, rank = order[keep], rank[keep]
            out = base.iloc[order].reset_index(drop=True).assign(score=scores[order], rank=rank)
        else:
            out = base.assign(score=pd.Series(dtype=np.float32), rank=pd.Series(dtype=np.int64))
        drop = [c for c, d in (("query_comp", self.drop_query_comp), ("doc_comp", self.drop_doc_comp)) if d]
        return out.drop(columns=[c for c in drop if c in out.columns])

    def fuse_rank_cutoff(self, k: int) -> MoLReranker:
        """``reranker % k``: the same re-ranker keeping ``min(k, num_results)`` per query."""
        k = _check_pos_int("k", k)
        out = copy.copy(self)
        out.num_results = k if self.num_results is None else min(k, self.num_results)
        return out

    def __repr__(self) -> str:
        return f"MoLReranker({self.index!r}, {type(self.mol).__name__}, num_results={self.num_results})"

    def subtransformers(self) -> dict:
        return {}


def _query_side(
    inp: pd.DataFrame, rows: np.ndarray, shapes: _Shapes, owner: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """``query_comp`` (and ``query_feat`` for a gate with side features) of ``rows``, stacked and checked."""
    namer = row_namer(inp)

    def name(i: int) -> str:
        return namer(int(rows[i]))

    Q = _components_matrix(
        inp["query_comp"].to_numpy()[rows], shapes.pq, shapes.dim, "query_comp", "query", name, owner
    )
    Qf = None
    if shapes.gate_features:
        Qf = _features_matrix(inp["query_feat"].to_numpy()[rows], shapes.feature_dim, "query_feat", name, owner)
    return Q, Qf


def _check_index_matches(index: MoLIndex, shapes: _Shapes) -> None:
    if index.num_components != shapes.px or index.dim != shapes.dim:
        raise ValueError(
            f"{index!r} holds {index.num_components} components of dim {index.dim} per document, but the MoL "
            f"expects P_x = {shapes.px} of dim {shapes.dim}: was the index built with this model's doc_encoder()?"
        )
    if shapes.gate_features:
        if index.feature_dim is None:
            raise ValueError(
                f"the MoL gate reads document features (gate_features=True) but {index!r} holds none: index "
                "with MoLEncoder(model).doc_encoder(), which adds doc_feat for such models"
            )
        if shapes.feature_dim is not None and index.feature_dim != shapes.feature_dim:
            raise ValueError(
                f"{index!r} holds {index.feature_dim}-dim document features, the MoL gate reads {shapes.feature_dim}"
            )


# --------------------------------------------------------------------------------------------------------
# retriever
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Block:
    """A query block's result: selected (query-in-block, docid, score, rank), per-query gap bound and counts."""

    qi: np.ndarray
    docids: np.ndarray
    scores: np.ndarray
    rank: np.ndarray
    gap: np.ndarray
    scored: np.ndarray


class MoLRetriever(pt.Transformer):
    """Top-K retrieval with a Mixture-of-Logits similarity from a :class:`~pyterrier_prob.MoLIndex` (Sec. 3).

    ``method`` picks the algorithm (see the module docstring): ``"exact"`` (Algorithm 1, two-pass with faiss
    range search; the default), ``"brute_force"``, ``"topk_per_embedding"`` (Algorithm 2 + TopKPerEmbedding,
    Theorem 2), ``"topk_avg"`` (Algorithm 2 + TopKAvg; exact for uniform gating), ``"comb_topk"`` (Combined top
    K, Theorem 3). Candidates are found with faiss (one ``IndexFlatIP`` per document component and one on the
    component means; on the GPU when faiss sees one) and re-scored with ``mol.score_candidates`` in torch.

    Input: a query frame with ``qid`` and ``query_comp`` (``(P_q, d)`` per row, :meth:`MoLEncoder.query_encoder`;
    plus ``query_feat`` for a gate with side features). A qid on several rows with the same ``query_comp`` is
    retrieved once (the first row's columns kept); with different ones it is a ValueError naming the qid and column.
    Output: ``qid, docno, docid, score, rank`` (+ ``gap_bound``, ``num_candidates`` when asked) and the query
    columns; ``retriever % k`` folds the cutoff in. A frame with ``docno`` is re-ranked instead
    (:class:`MoLReranker` over this index).

    Args:
        index: a :class:`~pyterrier_prob.MoLIndex` (or its path).
        mol: the MixtureOfLogits-like module scoring (query, item) pairs (:attr:`MoLEncoder.mol`); its gate must
            be a softmax (pi >= 0, summing to 1), which the exactness of Algorithm 1 and Theorems 2-3 rely on.
        method: one of :data:`METHODS`.
        num_results: K, the results per query.
        n_per_embedding: N (N1 for ``comb_topk``), the items taken per embedding pair; default K.
        n_avg: N (N2 for ``comb_topk``), the items taken by averaged dot product; default K.
        gap_bound: ``None``; ``"tight"`` (or ``True``): Theorem 2/3's bound per query in a ``gap_bound`` column;
            ``"loose"``: Appendix B's bound from the retrieved items only (per-embedding methods).
        count_candidates: add ``num_candidates``, the number of items scored with MoL for the query.
        batch_size: queries per block.
        gpu: search faiss on the GPU (``None``: when ``faiss.get_num_gpus() > 0``).
        searcher: run the candidate k-NN searches (per component, and on the means for TopKAvg) on an approximate
            index instead of exhaustively, as the paper's Sec. 4 candidate retrieval: ``{"backend": "ivf_flat",
            "nlist": 4096, "nprobe": 64}`` or ``{"backend": "hnsw", "ef_search": 512}`` (:meth:`MoLIndex.searcher`,
            built once and cached in the index folder). ``exact``'s range pass stays exhaustive, so it stays exact;
            ``gap_bound`` is refused (its theorems need exact candidate lists).
        drop_query_comp: drop ``query_comp`` from the output.
        verbose: progress bar over query blocks.
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
        count_candidates: bool = False,
        batch_size: int = QUERY_BATCH,
        gpu: bool | None = None,
        searcher: Mapping[str, Any] | None = None,
        drop_query_comp: bool = False,
        verbose: bool = False,
    ) -> None:
        self.index = as_mol_index(index)
        self.shapes = _mol_shapes(mol)
        _check_index_matches(self.index, self.shapes)
        self.mol = mol
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.method = method
        self.num_results = _check_pos_int("num_results", num_results)
        uses_pe = method in ("topk_per_embedding", "comb_topk")
        uses_avg = method in ("topk_avg", "comb_topk")
        if n_per_embedding is not None and not uses_pe:
            raise ValueError(f"n_per_embedding applies to topk_per_embedding and comb_topk, not method={method!r}")
        if n_avg is not None and not uses_avg:
            raise ValueError(f"n_avg applies to topk_avg and comb_topk, not method={method!r}")
        self.n_per_embedding = _check_pos_int("n_per_embedding", n_per_embedding, allow_none=True)
        self.n_avg = _check_pos_int("n_avg", n_avg, allow_none=True)
        if gap_bound is True:
            gap_bound = "tight"
        if gap_bound is False:
            gap_bound = None
        if gap_bound not in (None, "tight", "loose"):
            raise ValueError(f"gap_bound must be None, 'tight' (or True) or 'loose', got {gap_bound!r}")
        if gap_bound == "loose" and not uses_pe:
            raise ValueError(
                "gap_bound='loose' (Appendix B) bounds from the per-embedding top N; it applies to "
                f"topk_per_embedding and comb_topk, not method={method!r} (use 'tight')"
            )
        self.gap_bound = gap_bound
        self.count_candidates = bool(count_candidates)
        self.batch_size = _check_pos_int("batch_size", batch_size)
        self.gpu = gpu
        if searcher is not None:
            if not isinstance(searcher, Mapping) or "backend" not in searcher:
                raise ValueError(
                    "searcher must be a dict with 'backend' and its parameters, e.g. {'backend': 'ivf_flat', "
                    f"'nlist': 4096, 'nprobe': 64}}, got {searcher!r}"
                )
            if gap_bound is not None and method != "exact":
                raise ValueError(
                    "gap_bound certifies the top K only over exact candidate searches (Theorems 2-3 need each pair's "
                    "true top N): drop searcher= or gap_bound="
                )
            searcher = dict(searcher)
            self.index.searcher("mean", **searcher)  # built (or read from the cache) now: errors here, not mid-run
        self.searcher = searcher
        self.drop_query_comp = bool(drop_query_comp)
        self.verbose = bool(verbose)

    # ---- configuration -----------------------------------------------------------------------------------
    @property
    def _n1(self) -> int:
        return self.n_per_embedding or self.num_results

    @property
    def _n2(self) -> int:
        return self.n_avg or self.num_results

    def _use_gpu(self) -> bool:
        if self.gpu is not None:
            return bool(self.gpu)
        faiss = import_faiss()

        return faiss.get_num_gpus() > 0

    def __repr__(self) -> str:
        extra = ""
        if self.n_per_embedding is not None:
            extra += f", n_per_embedding={self.n_per_embedding}"
        if self.n_avg is not None:
            extra += f", n_avg={self.n_avg}"
        if self.gap_bound is not None:
            extra += f", gap_bound={self.gap_bound!r}"
        if self.searcher is not None:
            extra += f", searcher={self.searcher!r}"
        return (
            f"MoLRetriever({self.index!r}, {type(self.mol).__name__}, method={self.method!r}, "
            f"num_results={self.num_results}{extra})"
        )

    def fuse_rank_cutoff(self, k: int) -> MoLRetriever:
        """``retriever % k``: K = min(k, K), candidate depths N kept as they were (the same candidates, so the
        result is this retriever's list cut at k; ``gap_bound`` then bounds the top-k list)."""
        k = _check_pos_int("k", k)
        out = copy.copy(self)
        if self.method in ("topk_per_embedding", "comb_topk"):
            out.n_per_embedding = self._n1
        if self.method in ("topk_avg", "comb_topk"):
            out.n_avg = self._n2
        out.num_results = min(k, self.num_results)
        return out

    def subtransformers(self) -> dict:
        return {}

    # ---- transform -----------------------------------------------------------------------------------------
    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        hint = "encode the queries with MoLEncoder(model).query_encoder() >> retriever"
        cols = ["query_comp", "query_feat"] if self.shapes.gate_features else ["query_comp"]
        rerank = _validate_columns(self, inp, cols, hint, rerank=None)
        if rerank:
            reranker = MoLReranker(self.index, self.mol, self.num_results, drop_query_comp=self.drop_query_comp)
            return reranker(inp)
        inp = inp.reset_index(drop=True)
        if len(inp):
            inp = self._one_row_per_query(inp)
        extra: dict[str, Any] = {}
        if not len(inp):
            out = inp.assign(
                docno=pd.Series(dtype=object),
                docid=pd.Series(dtype=np.int64),
                score=pd.Series(dtype=np.float32),
                rank=pd.Series(dtype=np.int64),
            )
            if self.gap_bound is not None:
                out = out.assign(gap_bound=pd.Series(dtype=np.float64))
            if self.count_candidates:
                out = out.assign(num_candidates=pd.Series(dtype=np.int64))
        else:
            Q, Qf = _query_side(inp, np.arange(len(inp)), self.shapes, type(self).__name__)
            self.index.check_finite()
            rows, docids, scores, ranks, gaps, scored = [], [], [], [], [], []
            blocks = range(0, len(Q), self.batch_size)
            if self.verbose and len(blocks) > 1:
                blocks = pt.tqdm(blocks, desc=f"MoL {self.method}", unit="qblock")
            with _inference(self.mol):
                for q0 in blocks:
                    q1 = q0 + self.batch_size
                    blk = self._search_block(Q[q0:q1], None if Qf is None else Qf[q0:q1])
                    rows.append(blk.qi + q0)
                    docids.append(blk.docids)
                    scores.append(blk.scores)
                    ranks.append(blk.rank)
                    gaps.append(blk.gap)
                    scored.append(blk.scored)
            row = np.concatenate(rows)
            docid = np.concatenate(docids)
            out = inp.iloc[row].reset_index(drop=True)
            if self.gap_bound is not None:
                extra["gap_bound"] = np.concatenate(gaps)[row]
            if self.count_candidates:
                extra["num_candidates"] = np.concatenate(scored)[row]
            out = out.assign(
                docno=self.index.docno_array()[docid],
                docid=docid,
                score=np.concatenate(scores),
                rank=np.concatenate(ranks),
                **extra,
            )
        if self.drop_query_comp and "query_comp" in out.columns:
            out = out.drop(columns="query_comp")
        return out

    def _one_row_per_query(self, inp: pd.DataFrame) -> pd.DataFrame:
        """A query frame with each qid once (its first row); repeated qids must repeat their query exactly."""
        owner = type(self).__name__
        check_ids(inp, ["qid"], owner)
        codes, first = first_rows(inp["qid"])
        if len(first) == len(inp):
            return inp
        Q, Qf = _query_side(inp, first, self.shapes, owner)
        check_rows_match_query(inp, codes, first, "query_comp", Q, owner, ndim=2)
        if Qf is not None:
            check_rows_match_query(inp, codes, first, "query_feat", Qf, owner)
        return inp.iloc[first].reset_index(drop=True)

    # ---- search --------------------------------------------------------------------------------------------
    def _search_block(self, Q: np.ndarray, Qf: np.ndarray | None) -> _Block:
        """Top K of a block of queries ``Q (B, P_q, d)`` (gate features ``Qf``) by the configured method."""
        if self.method == "brute_force":
            return self._brute_force(Q, Qf)
        B, N, K = Q.shape[0], len(self.index), self.num_results
        n1, n2 = self._n1, self._n2
        parts_q, parts_d = [], []
        D = nbrs = None
        if self.method in ("exact", "topk_per_embedding", "comb_topk") or (
            self.method == "topk_avg" and self.gap_bound is not None
        ):
            depth = {"exact": K, "topk_per_embedding": n1, "comb_topk": n1, "topk_avg": 0}[self.method]
            search_depth = depth
            if self.gap_bound == "tight" and self.method != "exact":
                search_depth = depth + 1 if self.method == "topk_per_embedding" else depth + n2 + 1
            search_depth = max(search_depth, depth, 1)
            D, nbrs = self._knn_components(Q, search_depth)  # (B, Pq, Px, k)
            if depth:
                ids = nbrs[..., :depth].reshape(B, -1)
                parts_q.append(np.repeat(np.arange(B), ids.shape[1]))
                parts_d.append(ids.reshape(-1))
        avg_q = avg_d = None
        if self.method in ("topk_avg", "comb_topk"):
            _, Im = self._search(self.index.faiss_mean, Q.mean(axis=1), n2, part="mean")
            avg_q, avg_d = np.repeat(np.arange(B), Im.shape[1]), Im.reshape(-1)
            parts_q.append(avg_q)
            parts_d.append(avg_d)
        qi, di = _unique_pairs(np.concatenate(parts_q), np.concatenate(parts_d), N)
        scores = _score_pairs(self.mol, self.shapes, Q, Qf, qi, _index_docs(self.index, di))

        if self.method == "exact":
            qi, di, scores = self._second_pass(Q, Qf, D, qi, di, scores)
        sel, rank = _topk(qi, di, scores, K)
        scored = np.bincount(qi, minlength=B)
        gap = np.zeros(B, np.float64)
        if self.gap_bound is not None and self.method != "exact":
            s_k = np.full(B, np.inf)  # the K-th best MoL score returned (the last one when fewer than K)
            np.minimum.at(s_k, qi[sel], scores[sel].astype(np.float64))
            gap = np.maximum(0.0, self._outside_bound(D, nbrs, n1, avg_q, avg_d, N) - s_k)
        return _Block(qi[sel], di[sel], scores[sel], rank, gap, scored)

    def _outside_bound(
        self,
        D: np.ndarray,
        nbrs: np.ndarray,
        n1: int,
        avg_q: np.ndarray | None,
        avg_d: np.ndarray | None,
        n_docs: int,
    ) -> np.ndarray:
        """Per query, S of Theorem 2 / S' of Theorem 3 (``-inf`` when no item is left outside)."""
        B = D.shape[0]
        if self.method == "topk_per_embedding":
            col = n1 if self.gap_bound == "tight" else n1 - 1
            if col >= D.shape[-1]:
                return np.full(B, -np.inf)
            return D[..., col].reshape(B, -1).max(axis=1)
        if self.gap_bound == "loose":  # comb_topk: items outside X_{N1,p} score at most the N1-th dot product
            return D[..., n1 - 1].reshape(B, -1).max(axis=1) if n1 - 1 < D.shape[-1] else np.full(B, -np.inf)
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
        sel, rank = _topk(qi, di, scores, K)
        thresh = np.full(B, -np.inf)
        last = rank == K - 1
        thresh[qi[sel][last]] = scores[sel][last]  # queries with fewer than K candidates already hold every item
        active = np.flatnonzero(np.isfinite(thresh))
        if not active.size:
            return qi, di, scores
        radius = np.empty(active.size, np.float32)
        for j, b in enumerate(active):
            t = float(thresh[b])
            scale = max(1.0, abs(t), float(np.abs(D[b][np.isfinite(D[b])]).max(initial=0.0)))
            radius[j] = np.nextafter(np.float32(t - _RANGE_SLACK * scale), np.float32(-np.inf))
        # every (query, item) with some <f_pq(q), g_px(x)> >= the query's radius: one blocked scan per component
        pq, n_docs = self.shapes.pq, len(self.index)
        Qa = Q[active].reshape(-1, Q.shape[-1])
        row_radius = torch.from_numpy(np.repeat(radius, pq))[:, None]
        found = [np.zeros(0, np.int64)]
        for px in range(self.shapes.px):
            index = self.index.faiss_component(px)
            vectors = _flat_vectors(index)
            if vectors is None:  # pragma: no cover - the index's CPU component indexes are flat
                lims, dis, ids = index.range_search(np.ascontiguousarray(Qa), float(radius.min()))
                rows = np.repeat(np.arange(len(Qa)), np.diff(lims))
                hit = dis >= np.repeat(radius, pq)[rows]  # each query's own radius
                found.append(active[rows[hit] // pq].astype(np.int64) * n_docs + ids[hit])
                continue
            for a, S in _scan_blocks(vectors, Qa):
                r, c = torch.nonzero(S >= row_radius, as_tuple=True)
                found.append(active[r.numpy() // pq].astype(np.int64) * n_docs + (c.numpy() + a))
        keys = np.setdiff1d(
            _sorted_unique(np.concatenate(found)), qi.astype(np.int64) * n_docs + di, assume_unique=True
        )
        if keys.size:
            nq, nd = keys // n_docs, keys % n_docs
            ns = _score_pairs(self.mol, self.shapes, Q, Qf, nq, _index_docs(self.index, nd))
            qi, di, scores = np.concatenate([qi, nq]), np.concatenate([di, nd]), np.concatenate([scores, ns])
        return qi, di, scores

    def _search(
        self, make_index: Callable[..., Any], X: np.ndarray, k: int, part: int | str
    ) -> tuple[np.ndarray, np.ndarray]:
        """k-NN by inner product over a faiss flat index: faiss on the GPU (when enabled and k allows), a blocked
        torch scan of its vectors on the CPU, or the configured ``searcher`` (an approximate index of ``part``,
        :meth:`MoLIndex.searcher`); ``-inf`` / -1 beyond the index."""
        k_eff = min(k, len(self.index))
        if self.searcher is not None:
            hits = self.index.searcher(part, **self.searcher).search(X, -np.inf, k_eff)
            D = np.full((len(X), k), -np.inf)
            nbrs = np.full((len(X), k), -1, np.int64)
            counts = hits.counts
            col = np.arange(hits.docids.size) - np.repeat(hits.offsets[:-1], counts)
            row = np.repeat(np.arange(len(X)), counts)
            D[row, col] = hits.scores
            nbrs[row, col] = hits.docids
            return D, nbrs
        gpu = self._use_gpu() and k_eff <= _GPU_MAX_K
        index = make_index(gpu=gpu)
        vectors = None if gpu else _flat_vectors(index)
        if vectors is not None:
            D, nbrs = _knn_scan(vectors, X, k_eff)
        else:
            D, nbrs = index.search(np.ascontiguousarray(X, dtype=np.float32), k_eff)
        D = np.where(nbrs >= 0, D, -np.inf).astype(np.float64)
        if k_eff < k:
            D = np.pad(D, ((0, 0), (0, k - k_eff)), constant_values=-np.inf)
            nbrs = np.pad(nbrs, ((0, 0), (0, k - k_eff)), constant_values=-1)
        return D, nbrs.astype(np.int64)

    def _knn_components(self, Q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-k items of every pair (pq, px): dot products and docids, each ``(B, P_q, P_x, k)``."""
        B, pq, d = Q.shape
        flat = Q.reshape(B * pq, d)
        dot_list, nbr_list = [], []
        for px in range(self.shapes.px):
            D, nbrs = self._search(lambda gpu, px=px: self.index.faiss_component(px, gpu=gpu), flat, k, part=px)
            dot_list.append(D.reshape(B, pq, k))
            nbr_list.append(nbrs.reshape(B, pq, k))
        return np.stack(dot_list, axis=2), np.stack(nbr_list, axis=2)

    def _brute_force(self, Q: np.ndarray, Qf: np.ndarray | None) -> _Block:
        """phi of every (query, item) with ``mol.score_all``, in document chunks, keeping each query's top K."""
        B, N, K = Q.shape[0], len(self.index), self.num_results
        device, dtype = _device_dtype(self.mol)
        Qt, Qft = _tensor(Q, device, dtype), _tensor(Qf, device, dtype)
        comps, feats = self.index.components(), self.index.features()
        per_doc = self.shapes.px * self.shapes.dim + 4 * B * self.shapes.pq * self.shapes.px
        chunk = max(1, _SCORE_BUDGET // per_doc)
        qi, di, sc = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.float32)]
        pending = 0
        for c0 in range(0, N, chunk):
            c1 = min(N, c0 + chunk)
            x = _tensor(comps[c0:c1], device, dtype)
            kwargs = {}
            if Qft is not None:
                kwargs = {"q_features": Qft, "x_features": _tensor(feats[c0:c1], device, dtype)}
            S = self.mol.score_all(Qt, x, **kwargs)
            if tuple(S.shape) != (B, c1 - c0):
                raise ValueError(f"mol.score_all returned shape {tuple(S.shape)}, expected ({B}, {c1 - c0})")
            S = S.float().cpu()
            if not bool(torch.isfinite(S).all()):
                raise ValueError("the MoL produced non-finite scores (nan or inf)")
            # each query's top K of the chunk and every tie of its K-th score: a superset of its part of the top K
            kth = torch.topk(S, min(K, c1 - c0), dim=1).values[:, -1:]
            r, c = torch.nonzero(S >= kth, as_tuple=True)
            qi.append(r.numpy())
            di.append(c.numpy() + c0)
            sc.append(S[r, c].numpy())
            pending += r.numel()
            if pending > 8 * B * K:
                qi, di, sc = np.concatenate(qi), np.concatenate(di), np.concatenate(sc)
                sel, _ = _topk(qi, di, sc, K)
                qi, di, sc, pending = [qi[sel]], [di[sel]], [sc[sel]], sel.size
        qi, di, sc = np.concatenate(qi), np.concatenate(di), np.concatenate(sc)
        sel, rank = _topk(qi, di, sc, K)
        return _Block(qi[sel], di[sel], sc[sel], rank, np.zeros(B), np.full(B, N, np.int64))


# The index's factories, attached here as pyterrier-dr attaches its retrievers to FlexIndex, so that the index
# module never imports the retrieval module (no import cycle); ``pyterrier_prob.mol`` always imports this module.
def _index_retriever(self: MoLIndex, mol: Any, method: str = "exact", **kwargs: Any) -> MoLRetriever:
    """A :class:`~pyterrier_prob.MoLRetriever` over this index (keyword arguments are passed on)."""
    return MoLRetriever(self, mol, method=method, **kwargs)


def _index_reranker(self: MoLIndex, mol: Any, **kwargs: Any) -> MoLReranker:
    """A :class:`~pyterrier_prob.MoLReranker` looking document components up in this index."""
    return MoLReranker(self, mol, **kwargs)


MoLIndex.retriever = _index_retriever
MoLIndex.reranker = _index_reranker
